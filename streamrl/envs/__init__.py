"""Environments: multi-turn episodes, tools, and running them in isolated worker processes.

An `Environment` (`streamrl.envs.base`, whose docstring is the contract) sets an episode up
from a dataset row, answers each model turn with an observation and says when it is over, and
scores it; its state is plain JSON passed back into every call, so any worker serves any call.
`generator.env.fn` names one: a registered name (`single_turn`, the default: one turn scored by
the reward function; `calculator`, `python`, `guess`) or a user's class by import path.

Tools are Python functions with a JSON schema (`tools`), called in the Hermes or a tagged
format (`formats`) from a `ToolEnvironment` (`tool_env`). `EnvRunner` (`runner`) runs every
call in worker processes boxed in like the reward scorer's (`streamrl.isolation.pool`).

Modules: `config` (EnvConfig), `base`, `limits` (what the policy's text and an environment's
answers may grow to), `tools`, `formats`, `tool_env`, `registry`, `worker`, `runner`, and the
bundled environments `calculator`, `python_env` (its code runs in
`streamrl.isolation.box`), `guess`. `agent`: a user's agent function, run in the same workers
against the generator's endpoint (`generator.env.agent`); `calculator_agent`: the calculator
task written as such an agent.

Imports: `streamrl.config.base`, `streamrl.isolation`, `streamrl.rewards`.
"""

from streamrl.envs.base import EnvContext, Environment, Message, Reset, SingleTurnEnv, Step, Task
from streamrl.envs.config import EnvConfig
from streamrl.envs.formats import (
    TOOL_FORMATS,
    HermesFormat,
    TaggedFormat,
    ToolFormat,
    resolve_tool_format,
)
from streamrl.envs.registry import (
    ENVIRONMENTS,
    EnvLoadError,
    EnvResolutionError,
    check_env_name,
    registered_envs,
    resolve_env,
)
from streamrl.envs.runner import EnvRunner, EnvStats, Episode, FinishReason, Reply, Scored
from streamrl.envs.tool_env import ToolEnvironment
from streamrl.envs.tools import Tool, ToolCall, ToolDefinitionError, ToolResult, tool

__all__ = [
    "ENVIRONMENTS",
    "TOOL_FORMATS",
    "EnvConfig",
    "EnvContext",
    "EnvLoadError",
    "EnvResolutionError",
    "EnvRunner",
    "EnvStats",
    "Environment",
    "Episode",
    "FinishReason",
    "HermesFormat",
    "Message",
    "Reply",
    "Reset",
    "Scored",
    "SingleTurnEnv",
    "Step",
    "TaggedFormat",
    "Task",
    "Tool",
    "ToolCall",
    "ToolDefinitionError",
    "ToolEnvironment",
    "ToolFormat",
    "ToolResult",
    "check_env_name",
    "registered_envs",
    "resolve_env",
    "resolve_tool_format",
    "tool",
]
