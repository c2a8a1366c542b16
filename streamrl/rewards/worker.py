"""What runs inside a scorer's worker processes, and the check every returned score passes.

`RewardScorer` (streamrl.rewards.scoring) starts each worker with `init_worker`, which ties
the worker's life to its parent's and resolves the reward by name in the fresh process, holds
each until all have started with `wait_until_all_started`, and sends it calls as `call_reward`.
A value that is not a score in [0, 1] is turned into `RewardValueError` here, in the worker, so
only floats come back.
"""

from __future__ import annotations

import numbers
import os
from typing import TYPE_CHECKING

from streamrl.processes import die_with_parent
from streamrl.rewards.registry import RewardFn, resolve_reward

if TYPE_CHECKING:
    from multiprocessing.synchronize import Barrier

__all__ = [
    "STARTUP_TIMEOUT_S",
    "RewardValueError",
    "call_reward",
    "check_score",
    "init_worker",
    "wait_until_all_started",
]

STARTUP_TIMEOUT_S = 120.0  # a starting worker imports sympy and the user's module


class RewardValueError(ValueError):
    """A reward function returned something other than a score in [0, 1] or a bool."""


def check_score(value: object, fn_spec: str) -> float:
    """`value` as a float score in [0, 1]; bools and 0-d numpy/torch scalars are accepted.

    Raises:
        RewardValueError: anything else (a string, None, NaN, 1.5, −1).
    """
    if not isinstance(value, numbers.Real) and getattr(value, "ndim", None) == 0:
        value = value.item()  # type: ignore[attr-defined]
    if isinstance(value, numbers.Real) and 0.0 <= float(value) <= 1.0:  # NaN fails both
        return float(value)
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    raise RewardValueError(
        f"reward {fn_spec!r} returned {shown} of type {type(value).__name__}; a reward must "
        "return a score in [0, 1] or a bool (rescale other ranges inside the function)"
    )


# Set once per worker process by init_worker.
_worker_fn: RewardFn | None = None
_worker_spec = ""
_worker_barrier: Barrier | None = None


def init_worker(fn_spec: str, barrier: Barrier, parent_pid: int) -> None:
    """Pool initializer: die with the parent (SIGKILL: a SIGKILLed generator runs no cleanup,
    and its workers would live on, with them multiprocessing's resource tracker), then resolve
    the reward in this process (a registered name or import path resolves the same way as in
    the caller, which has already checked it)."""
    global _worker_fn, _worker_spec, _worker_barrier
    die_with_parent(parent_pid)
    _worker_fn, _worker_spec, _worker_barrier = resolve_reward(fn_spec), fn_spec, barrier


def wait_until_all_started() -> int:
    """Held until every worker of the pool runs one of these, so all have finished starting."""
    assert _worker_barrier is not None, "reward worker used before init_worker"
    _worker_barrier.wait(timeout=STARTUP_TIMEOUT_S)
    return os.getpid()


def call_reward(response: str, ground_truth: str, prompt: str | None) -> float:
    """One reward call; raises whatever the reward raises, or `RewardValueError`."""
    assert _worker_fn is not None, "reward worker used before init_worker"
    return check_score(_worker_fn(response, ground_truth, prompt=prompt), _worker_spec)
