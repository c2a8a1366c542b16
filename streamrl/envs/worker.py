"""What runs inside an environment worker process: loading the environment, and the reset,
step and score calls with the checks every answer passes before it leaves the worker.

The worker is boxed in by `streamrl.isolation.worker` (no credentials, a memory limit, dead with
its parent) before `load_environment` imports anything of the user's. Each call checks the
environment's answer here, in the worker, so only well-formed values come back: messages
with a string role and content (a step's: at most `MAX_OBSERVATION_MESSAGES`, their contents
cut to `observation_max_chars` in all, shared fairly), a state that is plain JSON of at most
`MAX_STATE_JSON_CHARS` characters nested at most `MAX_JSON_DEPTH` deep (round-tripped, so the
next call sees what any fresh process would; messages are round-tripped and bounded alike), a
finite turn reward, a score in [0, 1]. Anything else raises `EnvValueError`, a counted
env_error whose message names what to change.
"""

from __future__ import annotations

import json
import math
import numbers
import reprlib
from dataclasses import dataclass
from typing import Any, Literal

from streamrl.envs.base import (
    MAX_OBSERVATION_MESSAGES,
    EnvContext,
    Environment,
    Message,
    Reset,
    Step,
    Task,
)
from streamrl.envs.formats import TOOL_FORMATS
from streamrl.envs.limits import MAX_JSON_DEPTH, nesting_depth, truncate_all
from streamrl.envs.registry import EnvLoadError, EnvResolutionError, resolve_env
from streamrl.isolation.worker import loaded
from streamrl.rewards.registry import (
    RewardLoadError,
    RewardResolutionError,
    RewardSpec,
    resolve_reward,
)
from streamrl.rewards.worker import check_score

__all__ = [
    "MAX_STATE_JSON_CHARS",
    "EnvSpec",
    "EnvValueError",
    "Started",
    "call_reset",
    "call_score",
    "call_step",
    "checked_reset",
    "checked_step",
    "load_environment",
]

MAX_STATE_JSON_CHARS = 2**20
"""Largest episode state, in characters of JSON (1 MiB). The generator holds the state of every
episode in flight (thousands at once) and it crosses processes twice per call: at this cap a
thousand episodes hold ~1 GiB. Ample for what an episode must remember (counters, a board, a
scratch file); what is bigger belongs outside the state, re-derived from the task."""

_JSON_CHARS_PER_CHAR = 6  # JSON writes a control character as a 6-character \u escape


class EnvValueError(ValueError):
    """An environment answered with something malformed; the message says what."""


@dataclass(frozen=True)
class EnvSpec:
    """What a worker builds its environment from (picklable; sent to each spawned worker)."""

    fn: str
    reward: RewardSpec
    tool_format: Literal["hermes", "tagged"]
    observation_max_chars: int
    call_timeout_s: float
    memory_mb: int
    settings: dict[str, Any] | None = None


@dataclass(frozen=True)
class Started:
    """`call_reset`'s answer: the checked `Reset`, the template's `tools=` list and whether the
    environment offers tools at all (`Environment.offers_tools`)."""

    messages: list[Message]
    state: Any
    tools: list[dict[str, Any]] | None
    offers_tools: bool = False


def load_environment(spec: EnvSpec) -> Environment:
    """The environment `spec` names, constructed with its context (the pool's loader)."""
    cls = resolve_env(spec.fn)
    try:
        reward = resolve_reward(spec.reward)
    except RewardResolutionError as error:  # as transient as the reward's own error
        wrapped = EnvLoadError if isinstance(error, RewardLoadError) else EnvResolutionError
        raise wrapped(f"{error} (generator.reward.fn)") from error
    context = EnvContext(
        reward=reward,
        reward_fn=spec.reward.fn,
        tool_format=TOOL_FORMATS[spec.tool_format],
        observation_max_chars=spec.observation_max_chars,
        call_timeout_s=spec.call_timeout_s,
        memory_mb=spec.memory_mb,
        settings=spec.settings or {},
    )
    return cls(context)


def _env() -> Environment:
    return loaded()


def call_reset(task: Task) -> Started:
    return checked_reset(_env(), task)


def call_step(task: Task, state: Any, text: str) -> Step:
    return checked_step(_env(), task, state, text)


def checked_reset(env: Environment, task: Task) -> Started:
    """`env.reset(task)`, checked."""
    reset = env.reset(task)
    if not isinstance(reset, Reset):
        raise EnvValueError(f"{_name(env)}.reset returned {_shown(reset)}, not a Reset")
    messages = _messages(reset.messages, env, "reset")
    if not messages:
        raise EnvValueError(f"{_name(env)}.reset returned no messages: the model needs a prompt")
    state = _json_state(reset.state, env, "reset")
    return Started(messages, state, env.template_tools(), bool(env.offers_tools))


def checked_step(env: Environment, task: Task, state: Any, text: str) -> Step:
    """`env.step(task, state, text)`, checked."""
    step = env.step(task, state, text)
    if not isinstance(step, Step):
        raise EnvValueError(f"{_name(env)}.step returned {_shown(step)}, not a Step")
    messages = _messages(step.messages, env, "step")
    if not step.done and not messages:
        raise EnvValueError(
            f"{_name(env)}.step returned no messages for an episode that goes on; answer the "
            "turn with an observation, or return done=True"
        )
    reward = step.reward
    if reward is not None:
        if not isinstance(reward, numbers.Real) or not math.isfinite(reward):
            raise EnvValueError(f"{_name(env)}.step returned reward {_shown(reward)}")
        reward = float(reward)
    calls, errors = step.tool_calls, step.tool_errors
    if not (_count(calls) and _count(errors) and errors <= calls):
        raise EnvValueError(
            f"{_name(env)}.step returned tool_calls={_shown(calls)}, tool_errors="
            f"{_shown(errors)}; they are counts, with tool_errors ≤ tool_calls"
        )
    state = _json_state(step.state, env, "step")
    return Step(messages, state, bool(step.done), reward, int(calls), int(errors))


def _count(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def call_score(task: Task, state: Any, final: str) -> float:
    env = _env()
    return check_score(env.score(task, state, final), f"{_name(env)}.score")


def _messages(messages: object, env: Environment, where: str) -> list[Message]:
    """`messages` checked; a step's at most `MAX_OBSERVATION_MESSAGES`, their contents cut to
    `observation_max_chars` in all (`truncate_all`). A reset's are the prompt: not cut."""
    if not isinstance(messages, list):
        raise EnvValueError(f"{_name(env)}.{where} gave messages {_shown(messages)}, not a list")
    if where == "step" and len(messages) > MAX_OBSERVATION_MESSAGES:
        raise EnvValueError(
            f"{_name(env)}.step gave {len(messages)} messages; at most "
            f"{MAX_OBSERVATION_MESSAGES}: answer a turn in fewer messages (join what belongs "
            "together into one)"
        )
    for message in messages:
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise EnvValueError(
                f"{_name(env)}.{where} gave the message {_shown(message)}; a message is "
                '{"role": str, "content": str} (a tool\'s answer adds "name")'
            )
    if where == "reset":
        return _round_trip(messages, env, "reset's messages", max_chars=None)
    limit = env.context.observation_max_chars
    contents = truncate_all([m["content"] for m in messages], limit)
    checked = [{**m, "content": c} for m, c in zip(messages, contents, strict=True)]
    # the contents, at most `limit` characters, and as much again as any state for the rest
    most = MAX_STATE_JSON_CHARS + _JSON_CHARS_PER_CHAR * limit
    return _round_trip(checked, env, "step's messages", max_chars=most)


def _json_state(state: object, env: Environment, where: str) -> Any:
    return _round_trip(state, env, f"{where}'s state", max_chars=MAX_STATE_JSON_CHARS)


def _round_trip(value: object, env: Environment, what: str, max_chars: int | None) -> Any:
    """`value` through JSON, refused unless it is plain JSON nested at most `MAX_JSON_DEPTH`
    deep (measured first, without recursion) of at most `max_chars` characters."""
    fix = (
        f"keep episode data small and shallow: at most {MAX_JSON_DEPTH} levels of lists and "
        f"dicts, and a state of at most {MAX_STATE_JSON_CHARS} characters as JSON"
    )
    if nesting_depth(value) > MAX_JSON_DEPTH:
        raise EnvValueError(
            f"{_name(env)}: {what} nests more than {MAX_JSON_DEPTH} levels deep (or holds "
            f"itself); {fix}"
        )
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
    except MemoryError:
        raise EnvValueError(f"{_name(env)}: {what} is too large to write as JSON; {fix}") from None
    except (TypeError, ValueError) as exc:
        raise EnvValueError(
            f"{_name(env)}: {what} is not plain JSON ({exc}); keep episode data in dicts, "
            "lists, strings, numbers, bools and None"
        ) from None
    if max_chars is not None and len(text) > max_chars:
        raise EnvValueError(
            f"{_name(env)}: {what} is {len(text)} characters as JSON; at most {max_chars}: {fix}"
        )
    return json.loads(text)


def _name(env: Environment) -> str:
    return type(env).__name__


def _shown(value: object) -> str:
    """`value` for a message: a bounded repr (six levels deep at most, long items elided)."""
    text = reprlib.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
