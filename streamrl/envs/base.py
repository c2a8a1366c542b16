"""The environment interface: what a user implements to train on multi-turn episodes, and the
built-in single-turn environment every run uses unless `generator.env.fn` names another.

An episode is a conversation. The generator samples the model's turns (it owns the tokens:
it renders the messages with the tokenizer's chat template and keeps every token id exact);
an `Environment` sees only text — the dataset row, each assistant turn as text — and answers
with chat messages. Three calls:

    reset(task)              -> Reset(messages, state)
        Set an episode up from a dataset row (`Task`). `messages`: the conversation the
        model's first turn continues (usually `task.messages`; a tool environment may add a
        system message describing its tools). `state`: anything the episode must remember.

    step(task, state, text)  -> Step(messages, state, done, reward, tool_calls, tool_errors)
        `text`: the model's latest turn, as sampled. Answer with the observation `messages`
        to append before the model's next turn (tool results, a user message), the new state,
        and whether the episode is over (`done`; then `messages` is usually empty). `reward`:
        an optional reward for this turn, recorded with the episode. `tool_calls` /
        `tool_errors`: the tool calls this turn made and how many failed, for the run's
        metrics (`ToolEnvironment` fills them in).

    score(task, state, final) -> float | bool in [0, 1]
        Score the finished episode. `final`: the model's last turn. The default scores `final`
        against `task.ground_truth` with the configured reward function (`self.reward`,
        `generator.reward.fn`), exactly as a single-turn run does.

The state is a plain JSON value (dicts, lists, str, numbers, bools, None), returned by `reset`
and `step` and passed back into the next call. It goes back and forth between processes
(it is round-tripped through JSON after every call, so the next call sees exactly what a fresh
process would): keep nothing about an episode on `self`. Any worker may serve any call, and
an episode survives the restart of the worker that served its last call.

What runs where, and its limits (`generator.env`): every call runs in one of `workers` worker
processes (`streamrl.envs.runner`), without credentials in its environment, under an address-
space limit of `memory_mb`, with `call_timeout_s` per reset or step call and
`episode_timeout_s` for all of an episode's calls together. A call that raises, hangs, crashes
its worker or returns something malformed ends its episode (finish reason `env_error` or
`timeout`, counted) and scores 0; it never stops the generator (a tool that raises is not
such a failure: a `ToolEnvironment` answers it as an error message). A step's observation is
at most `MAX_OBSERVATION_MESSAGES` messages (more is a malformed answer) whose contents are cut
to `observation_max_chars` characters in all (shared among them, each saying what was cut),
and, rendered as tokens by the generator, to `observation_max_tokens`. The state and messages
must nest at most `streamrl.envs.limits.MAX_JSON_DEPTH` deep, and the state be at most
`streamrl.envs.worker.MAX_STATE_JSON_CHARS` characters as JSON. An episode still running after
`max_turns` model turns, or when it reaches `max_episode_tokens` tokens, ends there and is
scored as it stands. The model's turn is the policy's text, which can be anything: an
environment reads it in time linear in its length and answers what it cannot read with an
observation, so a degenerate policy costs only its own episode.

A user's environment lives at module level in an importable module and is named by import
path, `generator.env.fn = "my_pkg.envs:MyEnv"`; the class is constructed once per worker with
an `EnvContext`. Tools: subclass `streamrl.envs.tool_env.ToolEnvironment`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from streamrl.envs.formats import Message, ToolFormat

if TYPE_CHECKING:
    from streamrl.rewards.registry import RewardFn

__all__ = [
    "MAX_OBSERVATION_MESSAGES",
    "EnvContext",
    "Environment",
    "Message",
    "Reset",
    "SingleTurnEnv",
    "Step",
    "Task",
]

MAX_OBSERVATION_MESSAGES = 64
"""Most messages one step may answer with; each is rendered and tokenised by the generator, and
a turn is answered in one or a few (a tool environment: one per call it ran)."""


@dataclass(frozen=True)
class Task:
    """The dataset row an episode starts from (JSON values only).

    `messages`: the row's prompt as chat messages (`data.system_prompt` applied).
    `ground_truth`: the row's answer (`data.answer_field`).
    `prompt_text`: the prompt as rendered for the model before any environment changes it;
    reward functions get it as `prompt=`.
    `row`: the row's other fields (all but the prompt's and the answer's), for fields an
    environment reads itself (`extra_info`, an OpenEnv reset's `openenv_reset`).
    """

    messages: list[Message]
    ground_truth: str
    prompt_text: str = ""
    row: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Reset:
    """`reset`'s answer: the conversation before the model's first turn, and the state."""

    messages: list[Message]
    state: Any = None


@dataclass(frozen=True)
class Step:
    """`step`'s answer. `messages`: the observation, appended after the model's turn (at least
    one message unless `done`). `reward`: this turn's reward, if the environment gives one.
    `tool_calls`: tool calls the turn made; `tool_errors`: those answered with an error."""

    messages: list[Message] = field(default_factory=list)
    state: Any = None
    done: bool = False
    reward: float | None = None
    tool_calls: int = 0
    tool_errors: int = 0


@dataclass(frozen=True)
class EnvContext:
    """What an environment is constructed with, in its worker.

    `reward`: the configured reward function (`generator.reward.fn`), `reward_fn` its name;
    `tool_format`: how tool calls are written and answered (`streamrl.envs.formats`);
    `observation_max_chars` (a step's whole observation), `call_timeout_s`, `memory_mb`: the
    `generator.env` limits, for an environment that must stay inside them (a tool's
    subprocess).
    `settings`: a built-in environment's own settings (JSON; `openenv`: its relay's address).
    """

    reward: RewardFn
    reward_fn: str
    tool_format: ToolFormat
    observation_max_chars: int = 4000
    call_timeout_s: float = 60.0
    memory_mb: int = 4096
    settings: Mapping[str, Any] = field(default_factory=dict)


class Environment:
    """Base class of every environment; the module docstring is the contract.

    Subclasses override `step` (and usually `reset`); `score` defaults to the configured
    reward function on the final turn. Keep per-episode data in the state, never on `self`.
    """

    def __init__(self, context: EnvContext) -> None:
        self.context = context

    @property
    def reward(self) -> RewardFn:
        """The configured reward function: `reward(response, ground_truth, prompt=...)`."""
        return self.context.reward

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The OpenAI-style `tools=` list the generator passes to the chat template, or None."""
        return None

    @property
    def offers_tools(self) -> bool:
        """Whether the model is offered tools (recorded with each group, so the step line, the
        status and the health conditions watch tool use even while no call is made)."""
        return False

    def reset(self, task: Task) -> Reset:
        """Start an episode: by default the row's prompt as it is, and no state."""
        return Reset(list(task.messages))

    def step(self, task: Task, state: Any, text: str) -> Step:
        """Answer the model's turn `text` (module docstring)."""
        raise NotImplementedError(f"{type(self).__name__} must implement step()")

    def score(self, task: Task, state: Any, final: str) -> float | bool:
        """The finished episode's score in [0, 1]: by default the reward function on `final`."""
        return self.reward(final, task.ground_truth, prompt=task.prompt_text)


class SingleTurnEnv(Environment):
    """One model turn, scored by the reward function: today's single-turn training as an
    environment (`single_turn`, the default)."""

    def step(self, task: Task, state: Any, text: str) -> Step:
        return Step(state=state, done=True)
