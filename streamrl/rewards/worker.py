"""What runs inside a scorer's worker processes, and the check every returned score passes.

`RewardScorer` (streamrl.rewards.scoring) starts each worker with `init_worker`, which boxes
the worker in before any user code runs, then imports the reward — the only place a user's
module is ever imported:

* it dies with its parent, even a SIGKILLed one;
* its environment loses every credential and storage setting (`storage.credentials`): spawned
  workers start with a copy of the generator's environment, so they are removed here, in the
  child, before anything reads them;
* its address space is capped at `memory_mb` (RLIMIT_AS, soft and hard: the reward cannot
  raise it back), so a reward that allocates beyond it gets a MemoryError, a counted failure;
* the kernel's OOM killer takes it before anything else (oom_score_adj 1000, Linux).

`wait_until_all_started` holds each worker until all have loaded the reward, or carries the
load error (`RewardResolutionError`) back to the scorer; calls arrive as `call_reward`. A value
that is not a score in [0, 1] is turned into `RewardValueError` here, in the worker, so only
floats come back.

What the box does not do: the worker runs as the generator's user, so whatever that user may
read — `~/.aws/credentials`, `/proc/<pid>/environ` of its own start or of the generator — stays
readable. Keeping a hostile reward from those takes another user or a container.
"""

from __future__ import annotations

import numbers
import os
import resource
from typing import TYPE_CHECKING

from storage.credentials import remove_credentials
from streamrl.processes import die_with_parent
from streamrl.rewards.registry import RewardFn, RewardResolutionError, resolve_reward

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
_OOM_SCORE_ADJ = "/proc/self/oom_score_adj"


class RewardValueError(ValueError):
    """A reward function returned something other than a score in [0, 1] or a bool."""


def check_score(value: object, fn_spec: str) -> float:
    """`value` as a float score in [0, 1]; bools and 0-d numpy/torch scalars are accepted.

    Raises:
        RewardValueError: anything else (a string, None, NaN, ±inf, 1.5, −1, 10**400).
    """
    if not isinstance(value, numbers.Real) and getattr(value, "ndim", None) == 0:
        value = value.item()  # type: ignore[attr-defined]
    # Compared as returned, before float(): a huge int would overflow. NaN fails both bounds.
    if isinstance(value, numbers.Real) and 0 <= value <= 1:
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
_load_error: RewardResolutionError | None = None


def init_worker(fn_spec: str, barrier: Barrier, parent_pid: int, memory_mb: int) -> None:
    """Pool initializer: box this process in (module docstring), then resolve the reward here.
    A reward that cannot be resolved is kept as `_load_error` for `wait_until_all_started` to
    raise in the scorer, in resolve_reward's words; one whose import never ends is killed by
    the scorer at its startup limit."""
    global _worker_fn, _worker_spec, _worker_barrier, _load_error
    die_with_parent(parent_pid)
    remove_credentials(os.environ)
    _prefer_for_oom_killer()
    _limit_address_space(memory_mb)
    _worker_spec, _worker_barrier = fn_spec, barrier
    try:
        _worker_fn = resolve_reward(fn_spec)
    except RewardResolutionError as error:  # raised in the scorer by wait_until_all_started
        _load_error = error


def _prefer_for_oom_killer() -> None:
    """Linux: make this the OOM killer's first choice (1000 is the most; an unprivileged
    process may raise its own score)."""
    if os.path.exists(_OOM_SCORE_ADJ):
        with open(_OOM_SCORE_ADJ, "w") as f:
            f.write("1000")


def _limit_address_space(memory_mb: int) -> None:
    limit = memory_mb * 1024**2
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def wait_until_all_started(timeout_s: float) -> int:
    """Held until every worker of the pool runs one of these, so all have loaded the reward;
    raises the reward's load error instead, if it had one. Returns this worker's pid."""
    assert _worker_barrier is not None, "reward worker used before init_worker"
    if _load_error is not None:
        raise _load_error
    _worker_barrier.wait(timeout=timeout_s)
    return os.getpid()


def call_reward(response: str, ground_truth: str, prompt: str | None) -> float:
    """One reward call; raises whatever the reward raises, or `RewardValueError`."""
    assert _worker_fn is not None, "reward worker used before init_worker"
    return check_score(_worker_fn(response, ground_truth, prompt=prompt), _worker_spec)
