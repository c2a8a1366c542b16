"""Reward functions by name: the registered ones, or a user's by import path.

`generator.reward.fn` is either a registered name (`REWARD_FUNCTIONS`: math, format,
math_format, reasoning_gym (`streamrl.rewards.reasoning_gym`); `code`, which takes its
settings from `generator.reward.code`) or
`package.module:function`. A worker loads a `RewardSpec`: the name and those settings. A user
function must be importable in a fresh process — scorer workers are spawned and resolve the
name there — so it has to live at module level in a module on the Python path; there is
deliberately no runtime `register()`, whose entries a spawned worker would never see.

Importing a user's module runs user code, which may hang, hog memory or read credentials, so
only reward workers call `resolve_reward` (under their limits, `streamrl.isolation.worker`);
generators and evaluators call `check_reward_name`, which imports nothing of the user's.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NoReturn, Protocol

from streamrl.isolation.box import BoxUnavailableError, check_box
from streamrl.isolation.user_code import import_object, refuse_unknown_name, split_import_path
from streamrl.rewards.code.config import CodeRewardConfig
from streamrl.rewards.code.reward import CodeReward
from streamrl.rewards.math import format_reward, load_math_verify, math_format_reward, math_reward
from streamrl.rewards.reasoning_gym import load_reasoning_gym, reasoning_gym_reward

__all__ = [
    "REWARD_FUNCTIONS",
    "RewardFn",
    "RewardLoadError",
    "RewardResolutionError",
    "RewardSpec",
    "check_reward_name",
    "registered_rewards",
    "resolve_reward",
]

_SIGNATURE = "def reward(response: str, ground_truth: str, *, prompt: str | None = None) -> float"


class RewardFn(Protocol):
    """A verifiable reward: one response against its ground truth.

    Returns a score in [0, 1] (1 = correct) or a bool. It must be deterministic, must not rely
    on state shared between calls, and may take at most `reward.timeout_s` seconds; raising,
    timing out or returning anything else is counted as a failure (its group is dropped, or
    scored 0.0, per `reward.on_error`). A function without the `prompt` keyword is accepted
    too and called without it.
    """

    def __call__(
        self, response: str, ground_truth: str, *, prompt: str | None = None
    ) -> float | bool: ...


REWARD_FUNCTIONS: Mapping[str, RewardFn] = MappingProxyType(
    {
        "math": math_reward,
        "format": format_reward,
        "math_format": math_format_reward,
        "reasoning_gym": reasoning_gym_reward,
    }
)
CONFIGURED_REWARDS = ("code",)
"""Registered rewards built from their settings when a worker loads them."""


@dataclass(frozen=True)
class RewardSpec:
    """What a reward worker loads: `fn` (a registered name or an import path), the settings of
    the `code` reward, and `timeout_s`, each call's limit. Shown as `fn` in messages."""

    fn: str
    code: CodeRewardConfig = field(default_factory=CodeRewardConfig)
    timeout_s: float = 10.0

    def __str__(self) -> str:
        return self.fn


class RewardResolutionError(ValueError):
    """`reward.fn` names no usable reward function; the message says what to change. Raised as
    such (not as `RewardLoadError`), it fails the same way every time: the name, the module or
    the function is not there or does not fit."""


class RewardLoadError(RewardResolutionError):
    """The reward could not be loaded, which may not happen again: its module raised on import,
    the import was still running at `startup_timeout_s`, or a worker died while starting; the
    message says what to change."""


def registered_rewards() -> list[str]:
    """The registered reward names, sorted."""
    return sorted([*REWARD_FUNCTIONS, *CONFIGURED_REWARDS])


def check_reward_name(name_or_path: str) -> None:
    """Fail fast on what can be told without running user code: an unknown registered name, or
    an import path that is not `package.module:function` (a dotted name without the colon
    included). Whether the module imports and has that function is found out by the reward
    workers (`RewardScorer` raises it on start).

    Raises:
        RewardResolutionError: the message says what to change.
    """
    if ":" not in name_or_path:
        if name_or_path not in registered_rewards():
            _refuse_unknown(name_or_path)
        return
    _split_import_path(name_or_path)


def _split_import_path(name_or_path: str) -> tuple[str, str]:
    parts = split_import_path(name_or_path, dotted_attribute=False)
    if parts is None:
        raise RewardResolutionError(
            f"reward import path {name_or_path!r} must look like 'package.module:function'"
        )
    return parts


def resolve_reward(spec: str | RewardSpec) -> RewardFn:
    """The reward function `spec` names: a registered name or `package.module:function` (with
    its settings, for the registered rewards that take some).

    An import path imports the user's module in this process: call it in a reward worker, not
    in a generator (`check_reward_name`).

    Raises:
        RewardResolutionError: unknown name (the message lists the registered names and the
            closest one), a module that cannot be imported, a missing attribute, an object that
            is not callable, or a function whose parameters do not fit `RewardFn`.
    """
    spec = spec if isinstance(spec, RewardSpec) else RewardSpec(spec)
    name_or_path = spec.fn
    if ":" not in name_or_path:
        return _registered(spec)
    _split_import_path(name_or_path)
    target = import_object(name_or_path, "reward", RewardResolutionError, RewardLoadError)
    if not callable(target):
        raise RewardResolutionError(
            f"reward {name_or_path!r} is not callable (it is the {type(target).__name__} "
            f"{_short_repr(target)}); point reward.fn at a function `{_SIGNATURE}`"
        )
    return _adapt_signature(target, name_or_path)


def _short_repr(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _registered(spec: RewardSpec) -> RewardFn:
    name = spec.fn
    if name == "code":
        return _code_reward(spec)
    if name in REWARD_FUNCTIONS:
        # at resolution (a worker's startup), not in its first call's time
        try:
            load_reasoning_gym() if name == "reasoning_gym" else load_math_verify()
        except ImportError as missing:
            raise RewardResolutionError(str(missing)) from None
        return REWARD_FUNCTIONS[name]
    _refuse_unknown(name)


def _refuse_unknown(name: str) -> NoReturn:
    refuse_unknown_name(
        name,
        what="reward",
        example="math",
        registered=registered_rewards(),
        user_form="a user function as 'package.module:function'",
        error=RewardResolutionError,
    )


def _call_without_prompt(
    fn: Callable[[str, str], float | bool],
    response: str,
    ground_truth: str,
    *,
    prompt: str | None = None,
) -> float | bool:
    del prompt
    return fn(response, ground_truth)


def _binds(signature: inspect.Signature, *args: object, **kwargs: object) -> bool:
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def _adapt_signature(fn: Callable[..., object], name_or_path: str) -> RewardFn:
    """`fn` itself when it takes `prompt=`, else a wrapper that leaves `prompt` out."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: trust them
        return fn  # type: ignore[return-value]
    if _binds(signature, "response", "ground truth", prompt="prompt"):
        return fn  # type: ignore[return-value]
    if not _binds(signature, "response", "ground truth"):
        shown = signature.replace(
            parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
            return_annotation=signature.empty,
        )
        raise RewardResolutionError(
            f"reward {name_or_path!r} has parameters {shown}; a reward function is called "
            f"as fn(response, ground_truth, prompt=...): `{_SIGNATURE}`"
        )
    return functools.partial(_call_without_prompt, fn)  # type: ignore[return-value]


def _code_reward(spec: RewardSpec) -> RewardFn:
    """The `code` reward, once the box and the language's toolchain are there."""
    try:
        check_box()
        return CodeReward(spec.code, spec.timeout_s)
    except (BoxUnavailableError, ValueError) as error:
        raise RewardResolutionError(f"reward 'code' cannot run programs here: {error}") from None
