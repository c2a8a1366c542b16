"""Calls into user code in isolated worker processes, each call under a time limit: the one
mechanism behind the reward scorer (`streamrl.rewards.scoring`) and the environment runner
(`streamrl.envs.runner`).

`IsolatedPool` runs `workers` spawned processes, each boxed in by `streamrl.isolation.worker`
(an allowlisted environment, an address-space limit, dead with its parent, the OOM killer's
first choice, `nice` steps below the caller's CPU priority) before it loads the user's code
with the pool's loader. Callers from any number of threads `submit(fn, *args, timeout_s=...)`
and get a `Future[Outcome]` that never raises: user code may raise, hang or crash its
interpreter, and each of those comes back as an `Outcome` with `failure` set ("error" or
"timeout"). The caller counts, logs and words it.

How the time limit is kept. A running task cannot be cancelled in a ProcessPoolExecutor, so
one dispatcher thread owns the executor:

* at most `workers` calls are in it at once and every worker is started and idle before any
  call is handed to it, so a call starts the moment it is dispatched and its deadline is
  dispatch time + its `timeout_s`, never inflated by queueing behind other calls (calls wait
  in the pool's own queue, in submission order, until a worker is free);
* when a deadline passes, every worker is killed (SIGKILL: a stuck call cannot ignore it) and a
  fresh pool is started; the overdue calls fail as "timeout", and calls that were still within
  their limit are dispatched again to the new pool (callers submit only calls that may run
  twice: pure functions of their arguments);
* a worker that dies by itself (segfault, `os._exit`, the OOM killer) breaks the pool; the
  calls in flight at that moment cannot be told apart, so all of them fail as "error" and the
  pool is replaced.

Workers are spawned, not forked: the generator process holds vLLM/torch threads, and a fork
would copy their locks mid-flight. A worker is killed when the *thread* that started it ends
(`die_with_parent`), so every pool is started from the dispatcher, which lives while the pool
is open.

How loading is kept in bounds. A pool counts as started once every worker has loaded, within
`startup_timeout_s`. On entry a failure raises: the loader's own error when it is a
`resolution_error` (a name that is not there, in the loader's words), else `load_error` for a
load still running at the limit (its workers are killed), a loader that raised something
else, or a worker that died starting. A replacement pool that fails to start does not raise:
the calls waiting for it fail as "error", counted in `failed_starts`, and the next call
submitted tries again.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, FIRST_EXCEPTION, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Literal

from streamrl.isolation.worker import init_worker, wait_until_all_started

__all__ = ["Failure", "IsolatedPool", "Outcome"]

log = logging.getLogger(__name__)

Failure = Literal["error", "timeout"]
_LOST = "another call's worker process died"


@dataclass(frozen=True)
class Outcome:
    """How one call ended. `failure` None: it returned `value`. Else `value` is None and
    `reason` says why, in words ("it raised", "its worker process died", ...), with the
    exception it raised in its worker, if any. `elapsed_s`: dispatch to result, in seconds
    (of its last dispatch, when a timeout elsewhere made it run again)."""

    value: Any = None
    failure: Failure | None = None
    reason: str = ""
    exception: BaseException | None = None
    elapsed_s: float = 0.0


@dataclass
class _Call:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    timeout_s: float
    future: Future[Outcome]


class IsolatedPool:
    """`workers` boxed worker processes that have each run `load(spec)`, and a queue of calls.

    Use as a context manager: the workers start and load on entry (module docstring) and are
    killed on exit, after the calls already submitted have ended. `subject` names the user code
    in messages ("reward 'math'"), `setting` the config section holding its limits
    ("generator.reward").
    """

    def __init__(
        self,
        load: Callable[[Any], object],
        spec: Any,
        *,
        subject: str,
        setting: str,
        workers: int,
        memory_mb: int,
        nice: int = 0,
        startup_timeout_s: float,
        resolution_error: type[Exception],
        load_error: type[Exception],
    ) -> None:
        if not issubclass(load_error, resolution_error):
            raise TypeError("load_error must subclass resolution_error: a failed restart is both")
        self.load, self.spec = load, spec
        self.subject, self.setting = subject, setting
        self.workers, self.memory_mb, self.nice = workers, memory_mb, nice
        self.startup_timeout_s = startup_timeout_s
        self.resolution_error, self.load_error = resolution_error, load_error
        self.restarts = 0  # pools started in place of one killed or broken
        self.failed_starts = 0  # replacement pools that failed to start
        self._lock = threading.Lock()
        self._waiting: deque[_Call] = deque()
        self._wakeup: Future[None] = Future()
        self._open = self._closing = False
        self._dispatcher: threading.Thread | None = None
        self._executor: ProcessPoolExecutor | None = None  # None while open: start one
        self._worker_pids: list[int] = []

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (they change when a pool is replaced)."""
        return list(self._worker_pids)

    @property
    def is_open(self) -> bool:
        return self._open

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> IsolatedPool:
        with self._lock:
            if self._open:
                return self
            self._closing = False
        started: Future[None] = Future()
        self._dispatcher = threading.Thread(
            target=self._run, args=(started,), name=f"pool {self.subject}", daemon=True
        )
        self._dispatcher.start()
        started.result()  # the load error, if the first pool could not start
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop taking calls, let those submitted end, then kill the workers: idle workers hold
        nothing worth keeping, and user code that left a thread running cannot hang the exit."""
        with self._lock:
            self._closing = True
            self._wake()
        if self._dispatcher is not None:
            self._dispatcher.join()
            self._dispatcher = None

    def submit(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> Future[Outcome]:
        """Queue `fn(*args)` (a module-level function, run in a worker) with a time limit from
        its dispatch; the future's `Outcome` says how it ended and never raises."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        call = _Call(fn, args, timeout_s, Future())
        with self._lock:
            if not self._open or self._closing:
                raise RuntimeError(f"the worker pool of {self.subject} is not open")
            self._waiting.append(call)
            self._wake()
        return call.future

    def _wake(self) -> None:  # under self._lock
        if not self._wakeup.done():
            self._wakeup.set_result(None)

    # -- the dispatcher thread ---------------------------------------------------------------

    def _run(self, started: Future[None]) -> None:
        try:
            self._executor = self._new_executor()
        except BaseException as error:
            started.set_exception(error)
            return
        with self._lock:
            self._open = True
        started.set_result(None)
        running: dict[Future[Any], tuple[_Call, float, float]] = {}  # → (call, start, deadline)
        try:
            self._dispatch(running)
        except BaseException as error:  # a bug here must not leave callers waiting forever
            log.exception("the worker pool of %s failed; its calls fail", self.subject)
            why = f"the worker pool failed ({type(error).__name__}: {error})"
            self._fail_running(running, why)
            self._fail_waiting(why)
            raise
        finally:
            with self._lock:
                self._open = False
            self._drop_executor()

    def _dispatch(self, running: dict[Future[Any], tuple[_Call, float, float]]) -> None:
        while True:
            with self._lock:
                if self._wakeup.done():
                    self._wakeup = Future()
                wakeup = self._wakeup
                if self._closing and not self._waiting and not running:
                    return
                waiting = bool(self._waiting)
            if self._executor is None and waiting and (why := self._restart()) is not None:
                self._fail_waiting(why)
                continue
            if self._executor is not None:
                self._fill(running)
            timeout = None
            if running:
                timeout = max(0.0, min(d for _, _, d in running.values()) - time.monotonic())
            done, _ = wait([*running, wakeup], timeout=timeout, return_when=FIRST_COMPLETED)
            ended, dropped = self._settle(running, done)
            # A replaced pool is started before the calls that ended are answered, so a caller
            # that saw a timeout or a crash finds working workers (or the counted failure).
            if dropped and not self._closing and (why := self._restart()) is not None:
                self._fail_waiting(why)
            for call, outcome in ended:
                call.future.set_result(outcome)

    def _fill(self, running: dict[Future[Any], tuple[_Call, float, float]]) -> None:
        """Hand waiting calls to free workers. A pool found broken (a worker died after its
        last result came back) is dropped when nothing else runs in it, else settled next."""
        assert self._executor is not None
        while len(running) < self.workers:
            with self._lock:
                if not self._waiting:
                    return
                call = self._waiting.popleft()
            try:
                future = self._executor.submit(call.fn, *call.args)
            except BrokenProcessPool:
                with self._lock:
                    self._waiting.appendleft(call)
                if not running:
                    self._drop_executor()
                return
            now = time.monotonic()
            running[future] = (call, now, now + call.timeout_s)

    def _settle(
        self, running: dict[Future[Any], tuple[_Call, float, float]], done: set[Future[Any]]
    ) -> tuple[list[tuple[_Call, Outcome]], bool]:
        """The calls that ended (finished, failed or overdue) with their outcomes, and
        whether the pool was dropped."""
        ended: list[tuple[_Call, Outcome]] = []
        broken = False
        for future in done:
            if future not in running:
                continue  # the wakeup
            call, start, _ = running.pop(future)
            elapsed = time.monotonic() - start
            exc = future.exception()
            if exc is None:
                ended.append((call, Outcome(future.result(), elapsed_s=elapsed)))
            elif isinstance(exc, BrokenProcessPool):
                broken = True
                ended.append((call, _failed("error", "its worker process died", elapsed)))
            else:
                ended.append((call, _failed("error", "it raised", elapsed, exc)))
        now = time.monotonic()
        if broken:  # every call still in the broken pool is lost with it
            for call, start, _ in running.values():
                ended.append((call, _failed("error", _LOST, now - start)))
            running.clear()
            self._drop_executor()
            return ended, True
        overdue = [f for f, (_, _, deadline) in running.items() if deadline <= now]
        if not overdue:
            return ended, False
        for future in overdue:
            call, start, _ = running.pop(future)
            reason = f"it exceeded {call.timeout_s:.3g}s"
            ended.append((call, _failed("timeout", reason, now - start)))
        with self._lock:  # the others run again on the new pool, first
            self._waiting.extendleft(reversed([call for call, _, _ in running.values()]))
        running.clear()
        self._drop_executor()
        return ended, True

    def _fail_running(
        self, running: dict[Future[Any], tuple[_Call, float, float]], why: str
    ) -> None:
        for call, start, _ in running.values():
            call.future.set_result(_failed("error", why, time.monotonic() - start))
        running.clear()

    def _fail_waiting(self, why: str) -> None:
        with self._lock:
            calls, self._waiting = list(self._waiting), deque()
        for call in calls:
            call.future.set_result(_failed("error", why, 0.0))

    # -- starting and stopping workers -------------------------------------------------------

    def _restart(self) -> str | None:
        """Start a pool in place of the dropped one. None when it started; else why not (it
        is logged and counted; the next call submitted tries again)."""
        try:
            self._executor = self._new_executor()
        except self.resolution_error as error:  # deliberate: counted, and the caller goes on
            self.failed_starts += 1
            log.error(
                "%s: its workers could not be restarted; the calls waiting for them fail and "
                "the next call tries again: %s", self.subject, error,
            )  # fmt: skip
            return f"no workers ({type(error).__name__}: {error})"
        self.restarts += 1
        return None

    def _new_executor(self) -> ProcessPoolExecutor:
        context = multiprocessing.get_context("spawn")
        barrier = context.Barrier(self.workers)
        executor = ProcessPoolExecutor(
            max_workers=self.workers,
            mp_context=context,
            initializer=init_worker,
            initargs=(self.load, self.spec, barrier, os.getpid(), self.memory_mb, self.nice),
        )
        # The executor spawns one process per submit while none is idle, so `workers` submits
        # start all of them; the barrier returns only once each one has loaded.
        started = [
            executor.submit(wait_until_all_started, self.startup_timeout_s)
            for _ in range(self.workers)
        ]
        done, _ = wait(started, timeout=self.startup_timeout_s, return_when=FIRST_EXCEPTION)
        try:
            errors = [f.exception() for f in done if f.exception() is not None]
            if errors:
                raise self._start_error([e for e in errors if e is not None])
            if len(done) < len(started):
                raise self.load_error(
                    f"{self.subject} did not load within startup_timeout_s="
                    f"{self.startup_timeout_s:g}s: its worker processes were still starting "
                    "(importing its module) when the limit passed, so they were killed. An "
                    "import that waits on the network, a lock or input may never end: fix the "
                    f"module, or raise {self.setting}.startup_timeout_s if it is only slow"
                )
            self._worker_pids = sorted(f.result() for f in started)
        except BaseException:
            _kill_workers(executor)
            raise
        return executor

    def _start_error(self, errors: list[BaseException]) -> Exception:
        """The loader's own resolution error (the user's mistake, in its words), else a
        `load_error` naming what broke."""
        for error in errors:
            if isinstance(error, self.resolution_error):
                return error
        first = errors[0]
        return self.load_error(
            f"the workers of {self.subject} failed to start ({type(first).__name__}: {first}); "
            "a worker's own traceback, if any, is on stderr above. A worker that dies while "
            f"loading may need more than {self.setting}.memory_mb={self.memory_mb}"
        )

    def _drop_executor(self) -> None:
        if self._executor is not None:
            _kill_workers(self._executor)
            self._executor, self._worker_pids = None, []


def _failed(
    failure: Failure, reason: str, elapsed_s: float, exception: BaseException | None = None
) -> Outcome:
    return Outcome(None, failure, reason, exception, elapsed_s)


def _kill_workers(executor: ProcessPoolExecutor) -> None:
    """SIGKILL every worker of `executor` and release it; pending futures fail."""
    kill_workers = getattr(executor, "kill_workers", None)  # public from Python 3.14
    if kill_workers is not None:
        kill_workers()
    else:
        for process in list((executor._processes or {}).values()):
            process.kill()
    executor.shutdown(wait=True, cancel_futures=True)
