"""Bring your own agent: a user's agent function, run in an environment worker against the
generator's OpenAI-compatible endpoint (`streamrl.generator.endpoint`).

A user writes

    async def agent(client: openai.AsyncOpenAI, task: Task) -> str | float | None: ...

(or the same without `async`, taking an `openai.OpenAI`) at module level in an importable
module and names it by import path, `generator.env.agent = "my_pkg.agents:solve"`. `client`'s
base URL points at the generator for this one episode (its API key is the episode's token, so
no other process can sample through it); `task` is the dataset row (`Task`: `messages`,
`ground_truth`, `row`). The agent calls `client.chat.completions.create(...)` as often as it
likes (the `model` name is not read), with `tools=` for function calling; every token the
engine samples for it is recorded for training. Its return value:

- a string: its final answer, scored by the run's reward function (`generator.reward.fn`);
- None: its last assistant message is the final answer, scored so;
- a number or bool in [0, 1]: the episode's reward itself.

It runs like an environment (`streamrl.envs.base`): in one of `generator.env.workers` spawned
worker processes without credentials, under `memory_mb`, one episode per worker at a time for
its whole run, which `episode_timeout_s` bounds (sampling included); an agent that raises,
hangs or returns something else ends its episode as `env_error` / `timeout`, scoring 0.
The client never retries (a retry would sample again) and ignores proxy settings (the
endpoint is on 127.0.0.1).

An episode's agent runs once: when a worker is killed (another episode's timeout restarts the
pool) and the pool runs the call again, the endpoint refuses the second start and the
episode ends with what it sampled (`env_error`).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from streamrl.envs.base import Task
from streamrl.envs.registry import EnvLoadError, EnvResolutionError, check_agent_name
from streamrl.envs.worker import EnvValueError
from streamrl.isolation.user_code import import_object
from streamrl.isolation.worker import loaded

__all__ = [
    "AgentResult",
    "AgentSpec",
    "call_agent",
    "load_agent",
]

EPISODE_ENDED = "episode_ended"  # `streamrl.generator.agent_chat`'s error code for it
MAX_FINAL_CHARS = 2**20  # a returned answer is scored as text: bounded like a state


@dataclass(frozen=True)
class AgentSpec:
    """What an agent worker loads (picklable): the agent's import path."""

    fn: str


@dataclass(frozen=True)
class AgentResult:
    """What the agent returned, checked: its final answer (None: its last assistant message),
    or its reward."""

    final: str | None = None
    reward: float | None = None


def load_agent(spec: AgentSpec) -> Callable[..., Any]:
    """The agent function `spec` names (the pool's loader; imports the user's module)."""
    check_agent_name(spec.fn)
    agent = import_object(spec.fn, "agent", EnvResolutionError, EnvLoadError)
    if isinstance(agent, type) or not callable(agent):
        raise EnvResolutionError(
            f"agent {spec.fn!r} is {type(agent).__name__} {agent!r:.60}, not a function; "
            "point generator.env.agent at `async def agent(client, task)` (or a plain def)"
        )
    return agent


def call_agent(base_url: str, token: str, task: Task, timeout_s: float) -> AgentResult:
    """Run the loaded agent on `task` against the endpoint at `base_url` (in a worker). A
    request refused because a budget ended the episode ends the agent's run as it stands."""
    agent = loaded()
    options = {"base_url": base_url, "api_key": token, "max_retries": 0, "timeout": timeout_s}
    _start(base_url, token, timeout_s)
    try:
        result = _run(agent, options, task)
    except Exception as error:
        if not _episode_ended(error):
            raise
        return AgentResult()  # a budget ended the episode: scored as it stands
    return _checked(result, agent)


def _run(agent: Callable[..., Any], options: dict[str, Any], task: Task) -> Any:
    import openai

    if inspect.iscoroutinefunction(agent):

        async def run() -> Any:
            http = openai.DefaultAsyncHttpxClient(trust_env=False)
            async with openai.AsyncOpenAI(**options, http_client=http) as client:
                return await agent(client, task)

        return asyncio.run(run())
    with openai.OpenAI(**options, http_client=openai.DefaultHttpxClient(trust_env=False)) as c:
        result = agent(c, task)
    if inspect.isawaitable(result):
        raise EnvValueError(
            f"agent {_name(agent)} returned an awaitable from a plain function; make it "
            "`async def` so streamrl awaits it"
        )
    return result


def _episode_ended(error: BaseException | None) -> bool:
    """Whether `error` is (or was raised from) the endpoint's refusal of a request after a
    budget (max_turns, max_episode_tokens) ended the episode: not the agent's failure."""
    seen = 0
    while error is not None and seen < 16:
        if getattr(error, "code", None) == EPISODE_ENDED:
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _start(base_url: str, token: str, timeout_s: float) -> None:
    """Claim the episode's one run at the endpoint (module docstring): a replay is refused."""
    request = urllib.request.Request(
        f"{base_url}/streamrl/start", method="POST", headers={"Authorization": f"Bearer {token}"}
    )
    no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        no_proxy.open(request, timeout=timeout_s).close()
    except urllib.error.HTTPError as refused:
        why = refused.read(300).decode(errors="replace")
        raise EnvValueError(f"the endpoint refused the agent's start: {why}") from None


def _checked(result: object, agent: Callable[..., Any]) -> AgentResult:
    if result is None:
        return AgentResult()
    if isinstance(result, str):
        if len(result) > MAX_FINAL_CHARS:
            raise EnvValueError(
                f"agent {_name(agent)} returned an answer of {len(result)} characters; at most "
                f"{MAX_FINAL_CHARS}"
            )
        return AgentResult(final=result)
    if isinstance(result, numbers.Real) and math.isfinite(result) and 0 <= result <= 1:
        return AgentResult(reward=float(result))
    raise EnvValueError(
        f"agent {_name(agent)} returned {type(result).__name__} {result!r:.60}; return its "
        "final answer (str, scored by generator.reward), None (its last message is scored) or "
        "a reward in [0, 1]"
    )


def _name(agent: Callable[..., Any]) -> str:
    return getattr(agent, "__qualname__", repr(agent))
