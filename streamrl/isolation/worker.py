"""What runs inside an isolated pool's worker processes (`streamrl.isolation.pool`): the box a
worker is put in before any user code runs, and what it loads.

`IsolatedPool` starts each worker with `init_worker`, which boxes the worker in, then calls the
pool's loader — `resolve_reward` for the reward scorer, `streamrl.envs.worker.load_environment`
for environments: the only place a user's module is ever imported:

* it dies with its parent, even a SIGKILLed one;
* its environment keeps only what `WORKER_ENVIRONMENT` allows, so a secret under a name no
  rule knows (`MY_DB_DSN`, `WEIRD`) is gone too: spawned workers start with a copy of the
  generator's environment, so the rest is removed here, in the child, before anything reads
  it; processes the worker starts inherit the cleaned copy;
* its address space is capped at `memory_mb` (RLIMIT_AS, soft and hard: user code cannot
  raise it back), so an allocation beyond it gets a MemoryError, a counted failure;
* the kernel's OOM killer takes it before anything else (oom_score_adj 1000, Linux);
* it runs `nice` steps below the generator's CPU priority, it and every program it starts:
  where scoring and sampling share cores (a CPU generator), sampling gets them first and
  scoring takes what is left.

`wait_until_all_started` holds each worker until all have loaded, or carries the load error
back to the pool; calls then reach the loaded object through `loaded()` (a reward call:
`streamrl.rewards.worker.call_reward`; an environment's: `streamrl.envs.worker`).

What the box does not do: the worker runs as the generator's user, so whatever that user may
read — `~/.aws/credentials`, `/proc/<pid>/environ` of its own start or of the generator — stays
readable. Keeping hostile code from those takes another user or a container.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from storage.control.credentials import carries_credentials, is_credential_name, is_storage_setting
from streamrl.isolation.lifetime import die_with_parent

if TYPE_CHECKING:
    from multiprocessing.synchronize import Barrier

__all__ = [
    "STARTUP_TIMEOUT_S",
    "WORKER_ENVIRONMENT",
    "WORKER_ENVIRONMENT_PREFIXES",
    "box_in",
    "init_worker",
    "keep_worker_environment",
    "loaded",
    "loaded_from",
    "wait_until_all_started",
]

STARTUP_TIMEOUT_S = 120.0  # a starting worker imports sympy and the user's module
_OOM_SCORE_ADJ = "/proc/self/oom_score_adj"

WORKER_ENVIRONMENT = frozenset(
    {
        # the system: finding programs and libraries, the home and temporary directories,
        # who runs it, text encoding and time zone
        *("PATH", "LD_LIBRARY_PATH", "HOME", "TMPDIR", "USER", "LOGNAME", "LANG", "TZ"),
        # the interpreter: where its modules are, hashing and output as the generator has them
        *("PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE"),
        *("PYTHONIOENCODING", "PYTHONUTF8", "VIRTUAL_ENV"),
        # threads: a worker is one of many processes on the generator's cores (how many each
        # library starts, and OpenMP's idle waiting: `streamrl.placement.records`)
        *("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE"),
        *("OPENBLAS_L2_SIZE", "TOKENIZERS_PARALLELISM"),
        *("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"),
        # the GPUs the generator was given: without it a worker that uses CUDA sees them all
        "CUDA_VISIBLE_DEVICES",
        # caches and offline switches of the libraries a reward reads data with (paths and
        # flags, never tokens: HF_TOKEN stays behind)
        *("HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE", "XDG_CACHE_HOME"),
        *("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "NLTK_DATA"),
    }
)
"""What a reward or environment worker's environment keeps; everything else the generator
had is removed (`keep_worker_environment`), so a secret under a name no rule knows is not
seen by user code either. Groups: the system, the interpreter, thread counts, the GPUs, and
library caches and offline switches. None of them holds a secret."""
WORKER_ENVIRONMENT_PREFIXES = ("LC_", "STREAMRL_")
"""Families of names a worker keeps too: the locale's categories (`LC_ALL`, `LC_CTYPE`) and
streamrl's own settings (`STREAMRL_CACHE`, `STREAMRL_LOG_LEVEL`; none is a secret)."""


# Set once per worker process by init_worker.
_loaded: Any = None
_spec: Any = None
_barrier: Barrier | None = None
_load_error: Exception | None = None


def box_in(parent_pid: int, memory_mb: int, nice: int = 0) -> None:
    """Box this process in (module docstring): dead with its parent, only the environment
    `WORKER_ENVIRONMENT` allows, the OOM killer's first choice, at most `memory_mb` of address
    space, `nice` steps below its parent's CPU priority."""
    die_with_parent(parent_pid)
    keep_worker_environment(os.environ)
    _prefer_for_oom_killer()
    limit_address_space(memory_mb)
    os.nice(nice)


def init_worker(
    load: Callable[[Any], object],
    spec: Any,
    barrier: Barrier,
    parent_pid: int,
    memory_mb: int,
    nice: int,
) -> None:
    """Pool initializer: box this process in, then `load(spec)` here. A load that raises is kept
    as `_load_error` for `wait_until_all_started` to raise in the pool; one that never ends is
    killed by the pool at its startup limit."""
    global _loaded, _spec, _barrier, _load_error
    box_in(parent_pid, memory_mb, nice)
    _spec, _barrier = spec, barrier
    try:
        _loaded = load(spec)
    except Exception as error:  # raised in the pool by wait_until_all_started
        _load_error = error


def keep_worker_environment(environ: MutableMapping[str, str]) -> list[str]:
    """Delete from `environ` (e.g. `os.environ`, which also unsets them for child processes)
    every variable outside `WORKER_ENVIRONMENT` and `WORKER_ENVIRONMENT_PREFIXES`, and any that
    still looks like a credential or storage setting (`storage.control.credentials`) by its name or
    value; returns the names removed, sorted."""
    removed = sorted(name for name, value in environ.items() if not _kept(name, value))
    for name in removed:
        del environ[name]
    return removed


def _kept(name: str, value: str) -> bool:
    allowed = name in WORKER_ENVIRONMENT or name.startswith(WORKER_ENVIRONMENT_PREFIXES)
    secret = is_credential_name(name) or is_storage_setting(name) or carries_credentials(value)
    return allowed and not secret


def _prefer_for_oom_killer() -> None:
    """Linux: make this the OOM killer's first choice (1000 is the most; an unprivileged
    process may raise its own score)."""
    if os.path.exists(_OOM_SCORE_ADJ):
        with open(_OOM_SCORE_ADJ, "w") as f:
            f.write("1000")


def limit_address_space(memory_mb: int) -> None:
    """Cap this process's address space (RLIMIT_AS, soft and hard) at `memory_mb`, or at the
    hard limit it already has if that is lower."""
    limit = memory_mb * 1024**2
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def wait_until_all_started(timeout_s: float) -> int:
    """Held until every worker of the pool runs one of these, so all have loaded; raises the
    load error instead, if there was one. Returns this worker's pid."""
    assert _barrier is not None, "worker used before init_worker"
    if _load_error is not None:
        raise _load_error
    _barrier.wait(timeout=timeout_s)
    return os.getpid()


def loaded() -> Any:
    """What this worker's loader returned (a reward function, an environment)."""
    assert _barrier is not None, "worker used before init_worker"
    assert _load_error is None, "worker used although its load failed"
    return _loaded


def loaded_from() -> Any:
    """What this worker's loader was given (the reward's import path, the environment's
    spec), for messages."""
    assert _barrier is not None, "worker used before init_worker"
    return _spec
