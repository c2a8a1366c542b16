"""Scoring responses in isolated worker processes, each call under a time limit.

`RewardScorer` runs the reward function in a `ProcessPoolExecutor` of `workers` spawned
processes. A reward function is user code over model output: it may raise, return garbage,
loop forever or crash its interpreter. None of that raises in the caller: such a call scores
0.0, is marked failed in the batch's `Scores` (so the caller can drop the group instead of
training on it as wrong; `generator.reward.on_error`), is counted in `RewardScorer.stats` and
is logged.

How the time limit is kept. A running task cannot be cancelled in a ProcessPoolExecutor, so:

* at most `workers` calls are in the pool at once and every worker is started and idle before
  a batch begins, so a call starts the moment it is submitted and its deadline is
  submit time + `timeout_s`, never inflated by queueing behind other calls;
* when a deadline passes, every worker of the pool is killed (SIGKILL: a stuck call cannot
  ignore it) and a fresh pool is started; the overdue calls score 0.0, and calls that were
  still within their limit are submitted again to the new pool (rewards are pure functions);
* a worker that dies by itself (segfault, `os._exit`, the OOM killer) breaks the pool; the
  calls in flight at that moment cannot be told apart, so all of them score 0.0 as errors and
  the pool is replaced.

Workers are spawned, not forked: the generator process holds vLLM/torch threads, and a fork
would copy their locks mid-flight. Each worker is boxed in — no credentials in its
environment, an address-space limit of `memory_mb`, the OOM killer's first choice, dead with
its parent — and only then imports the reward (`streamrl.rewards.worker`): a user's module is
imported nowhere else, so the caller only checks the name (`check_reward_name`).

How loading is kept in bounds. A pool counts as started once every worker has loaded the
reward, within `startup_timeout_s`. On entry a failure raises: `RewardResolutionError` for a
module or function that is not there (in the same words as `resolve_reward`), `RewardLoadError`
for an import still running at the limit (its workers are killed) or a worker that died
starting. A replacement pool that fails to start (the import hangs now) does not raise: the
calls waiting for it score 0.0 as errors, counted, and the next batch tries again.

`score()` may be called from several threads; batches are then scored one after another.
Scores are raw, in [0, 1]; `streamrl.algorithms.shaping.scale_rule_reward` maps them to the
rule reward (±1 or 1/0) in the generator.

One job in one file (~450 lines, a third of them this docstring): the pool, its deadlines and
its restarts keep one invariant together (a call's deadline is its submit time), which a
split would spread over two files.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from collections import deque
from concurrent.futures import (
    FIRST_COMPLETED,
    FIRST_EXCEPTION,
    Future,
    ProcessPoolExecutor,
    ThreadPoolExecutor,
    wait,
)
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Literal

from streamrl.rewards.registry import RewardResolutionError, check_reward_name
from streamrl.rewards.worker import (
    STARTUP_TIMEOUT_S,
    RewardValueError,
    call_reward,
    init_worker,
    wait_until_all_started,
)

if TYPE_CHECKING:
    from streamrl.rewards.config import RewardConfig

__all__ = ["Failure", "RewardLoadError", "RewardScorer", "Scores", "ScoringStats"]

log = logging.getLogger(__name__)

Failure = Literal["error", "timeout"]


class RewardLoadError(RewardResolutionError):
    """The reward workers could not load the reward: its import was still running at
    `startup_timeout_s`, or a worker died while starting; the message says what to change."""


@dataclass(frozen=True)
class Scores:
    """One batch's outcome, in input order.

    `values[i]`: response i's score in [0, 1], 0.0 when its call failed.
    `failures[i]`: None when the reward scored it, else why not: "error" (it raised, returned
    something other than a score, or its worker process died) or "timeout".
    """

    values: list[float]
    failures: list[Failure | None]

    @property
    def errors(self) -> int:
        return self.failures.count("error")

    @property
    def timeouts(self) -> int:
        return self.failures.count("timeout")

    @property
    def any_failed(self) -> bool:
        return any(f is not None for f in self.failures)

    @property
    def all_failed(self) -> bool:
        return bool(self.failures) and all(f is not None for f in self.failures)


@dataclass
class ScoringStats:
    """Counters since the scorer opened. Every call ends as exactly one of: scored (its value,
    possibly 0.0), `timeouts`, `errors`. `pool_restarts` counts pools started in place of one
    killed (a timeout) or broken (a worker died); `failed_starts` those that failed to start
    (the calls waiting for them are among `errors`)."""

    calls: int = 0
    timeouts: int = 0
    errors: int = 0
    pool_restarts: int = 0
    failed_starts: int = 0


class RewardScorer:
    """Scores batches of responses with one reward function in `workers` worker processes.

    Use as a context manager: the workers start on entry — and load the reward, so a reward
    that cannot be loaded fails there (module docstring) — and are shut down on exit.

        with RewardScorer("math", workers=2, timeout_s=10.0) as scorer:
            scores = scorer.score(responses, ground_truths).values
    """

    def __init__(
        self,
        fn: str,
        *,
        workers: int = 2,
        timeout_s: float = 10.0,
        memory_mb: int = 4096,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be ≥ 1, got {workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if memory_mb < 1:
            raise ValueError(f"memory_mb must be ≥ 1, got {memory_mb}")
        if not startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s}")
        check_reward_name(fn)  # unknown names and malformed paths fail here, in the caller
        self.fn = fn
        self.workers = workers
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.startup_timeout_s = startup_timeout_s
        self.stats = ScoringStats()
        self._lock = threading.Lock()
        self._open = False
        self._pool: ProcessPoolExecutor | None = None  # None while open: start one next batch
        self._spawner: ThreadPoolExecutor | None = None  # the one thread that starts pools
        self._worker_pids: list[int] = []
        self._tracebacks_logged: set[str] = set()

    @classmethod
    def from_config(cls, config: RewardConfig) -> RewardScorer:
        """A scorer for `generator.reward`."""
        return cls(
            config.fn,
            workers=config.workers,
            timeout_s=config.timeout_s,
            memory_mb=config.memory_mb,
            startup_timeout_s=config.startup_timeout_s,
        )

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (they change when a pool is replaced)."""
        return list(self._worker_pids)

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> RewardScorer:
        with self._lock:
            if not self._open:
                try:
                    self._pool = self._start_pool()
                except BaseException:
                    self._stop_spawner()
                    raise
                self._open = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers, after a batch another thread is scoring has finished.

        Between batches the workers are idle and hold nothing worth keeping, so they are
        killed rather than asked to exit: a reward that left a non-daemon thread running in
        its worker cannot hang the exit.
        """
        with self._lock:
            self._open = False
            self._drop_pool()
            self._stop_spawner()

    def _stop_spawner(self) -> None:
        if self._spawner is not None:
            self._spawner.shutdown(wait=True)
            self._spawner = None

    def _start_pool(self) -> ProcessPoolExecutor:
        """A pool whose workers have all loaded the reward, started from the scorer's own
        thread: a worker is killed when the thread that started it ends (`die_with_parent`), so
        a pool must not be started from a caller's thread, which may end while the pool is in
        use."""
        if self._spawner is None:
            self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-pool")
        return self._spawner.submit(self._new_pool).result()

    def _new_pool(self) -> ProcessPoolExecutor:
        context = multiprocessing.get_context("spawn")
        barrier = context.Barrier(self.workers)
        pool = ProcessPoolExecutor(
            max_workers=self.workers,
            mp_context=context,
            initializer=init_worker,
            initargs=(self.fn, barrier, os.getpid(), self.memory_mb),
        )
        # The pool spawns one process per submit while none is idle, so `workers` submits
        # start all of them; the barrier returns only once each one has loaded the reward.
        started = [
            pool.submit(wait_until_all_started, self.startup_timeout_s) for _ in range(self.workers)
        ]
        done, _ = wait(started, timeout=self.startup_timeout_s, return_when=FIRST_EXCEPTION)
        try:
            errors = [f.exception() for f in done if f.exception() is not None]
            if errors:
                raise self._start_error(errors)
            if len(done) < len(started):
                raise RewardLoadError(
                    f"reward {self.fn!r} did not load within startup_timeout_s="
                    f"{self.startup_timeout_s:g}s: its worker processes were still starting "
                    "(importing the reward's module) when the limit passed, so they were "
                    "killed. An import that waits on the network, a lock or input may never "
                    "end: fix the module, or raise generator.reward.startup_timeout_s if it is "
                    "only slow"
                )
            self._worker_pids = sorted(f.result() for f in started)
        except BaseException:
            _kill_workers(pool)
            raise
        return pool

    def _start_error(self, errors: list[BaseException]) -> RewardResolutionError:
        """The load error a worker carried back (the user's mistake, in resolve_reward's
        words), else a `RewardLoadError` naming what broke."""
        for error in errors:
            if isinstance(error, RewardResolutionError):
                return error
        first = errors[0]
        return RewardLoadError(
            f"reward workers for {self.fn!r} failed to start ({type(first).__name__}: "
            f"{first}); a worker's own traceback, if any, is on stderr above. A worker that "
            f"dies while importing the reward may need more than generator.reward.memory_mb="
            f"{self.memory_mb}"
        )

    def _drop_pool(self) -> None:
        if self._pool is not None:
            _kill_workers(self._pool)
            self._pool, self._worker_pids = None, []

    def _restart_pool(self) -> str | None:
        """Start a pool in place of the dropped one. None when it started; else why not (it
        is logged and counted, and the next batch tries again)."""
        try:
            self._pool = self._start_pool()
        except RewardResolutionError as error:  # deliberate: counted, and the generator goes on
            self.stats.failed_starts += 1
            log.error(
                "reward %r: its workers could not be restarted; the calls waiting for them "
                "count as failed (score 0) and the next batch tries again: %s", self.fn, error,
            )  # fmt: skip
            return f"no reward workers ({type(error).__name__}: {error})"
        self.stats.pool_restarts += 1
        return None

    # -- scoring -----------------------------------------------------------------------------

    def score(
        self,
        responses: list[str],
        ground_truths: list[str],
        prompts: list[str] | None = None,
    ) -> Scores:
        """One score in [0, 1] per response, in input order, and which calls failed.

        A call that raises, returns something other than a score, exceeds `timeout_s`, kills
        its worker or finds no workers to run on (module docstring) scores 0.0, is marked in
        `Scores.failures` and counted in `stats`; this never raises for them.
        """
        if len(ground_truths) != len(responses) or (
            prompts is not None and len(prompts) != len(responses)
        ):
            raise ValueError(
                f"score() needs one ground truth (and prompt, if given) per response: got "
                f"{len(responses)} responses, {len(ground_truths)} ground truths, "
                f"{'no' if prompts is None else len(prompts)} prompts"
            )
        with self._lock:
            if not self._open:
                raise RuntimeError(
                    "RewardScorer is not open; use it as `with RewardScorer(...) as scorer:`"
                )
            try:
                return self._score_batch(responses, ground_truths, prompts)
            except BaseException:
                # Interrupted mid-batch (e.g. KeyboardInterrupt): calls may still be running.
                self._drop_pool()
                raise

    def _score_batch(
        self, responses: list[str], ground_truths: list[str], prompts: list[str] | None
    ) -> Scores:
        scores = [0.0] * len(responses)
        failures: list[Failure | None] = [None] * len(responses)
        waiting = deque(range(len(responses)))
        running: dict[Future[float], tuple[int, float]] = {}  # → (index, deadline)
        self.stats.calls += len(responses)
        start_failed = False
        while waiting or running:
            if self._pool is None and (why := self._restart_pool()) is not None:
                # A pool is dropped only with nothing in flight: the rest were waiting.
                for i in waiting:
                    failures[i] = self._count_error(i, responses[i], why)
                start_failed = True
                break
            assert self._pool is not None
            while waiting and len(running) < self.workers:
                i = waiting.popleft()
                prompt = prompts[i] if prompts is not None else None
                try:
                    future = self._pool.submit(call_reward, responses[i], ground_truths[i], prompt)
                except BrokenProcessPool:  # a worker died after its last result came back
                    waiting.appendleft(i)
                    if not running:  # else their futures fail too; handled below
                        self._drop_pool()
                    break
                running[future] = (i, time.monotonic() + self.timeout_s)
            if not running:
                continue
            next_deadline = min(deadline for _, deadline in running.values())
            done, _ = wait(
                running, timeout=max(0.0, next_deadline - time.monotonic()),
                return_when=FIRST_COMPLETED,
            )  # fmt: skip
            broken = False
            for future in done:
                i, _ = running.pop(future)
                exc = future.exception()
                if exc is None:
                    scores[i] = future.result()
                elif isinstance(exc, BrokenProcessPool):
                    broken = True
                    failures[i] = self._count_error(i, responses[i], "its worker process died")
                elif isinstance(exc, RewardValueError):
                    failures[i] = self._count_error(i, responses[i], str(exc))
                else:
                    failures[i] = self._count_error(i, responses[i], "it raised", exc)
            now = time.monotonic()
            overdue = [f for f, (_, deadline) in running.items() if deadline <= now]
            if broken:
                # Every call still in the broken pool is lost with it.
                for i, _ in running.values():
                    failures[i] = self._count_error(
                        i, responses[i], "another call's worker process died"
                    )
                running.clear()
                self._drop_pool()
            elif overdue:
                for future in overdue:
                    i, _ = running.pop(future)
                    failures[i] = self._count_timeout(i, responses[i])
                waiting.extendleft(sorted((i for i, _ in running.values()), reverse=True))
                running.clear()
                self._drop_pool()
        if self._pool is None and not start_failed:
            self._restart_pool()  # ready for the next batch; a failure is counted, retried then
        return Scores(scores, failures)

    def _count_timeout(self, index: int, response: str) -> Failure:
        self.stats.timeouts += 1
        log.warning(
            "reward %r exceeded timeout_s=%.3g on response %d of the batch (%s); its worker was "
            "killed and the call counts as failed (score 0). Raise generator.reward.timeout_s "
            "if such calls are legitimately slow.",
            self.fn, self.timeout_s, index, _preview(response),
        )  # fmt: skip
        return "timeout"

    def _count_error(
        self, index: int, response: str, what: str, exc: BaseException | None = None
    ) -> Failure:
        """Count a failed call; an exception's (remote) traceback is logged for the first
        failure of its type, its one-line form for every one."""
        self.stats.errors += 1
        kind = type(exc).__name__
        with_traceback = exc is not None and kind not in self._tracebacks_logged
        if exc is not None:
            self._tracebacks_logged.add(kind)
            what = f"{what} {kind}: {exc}"
        log.warning(
            "reward %r failed on response %d of the batch (%s): %s; it counts as failed (score 0)",
            self.fn, index, _preview(response), what,
            exc_info=exc if with_traceback else None,
        )  # fmt: skip
        return "error"


def _preview(response: str, limit: int = 60) -> str:
    text = response if len(response) <= limit else "…" + response[-limit:]
    return repr(text)


def _kill_workers(pool: ProcessPoolExecutor) -> None:
    """SIGKILL every worker of `pool` and release it; pending futures fail."""
    kill_workers = getattr(pool, "kill_workers", None)  # public from Python 3.14
    if kill_workers is not None:
        kill_workers()
    else:
        for process in list((pool._processes or {}).values()):
            process.kill()
    pool.shutdown(wait=True, cancel_futures=True)
