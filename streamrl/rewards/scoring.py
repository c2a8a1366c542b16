"""Scoring responses in isolated worker processes, each call under a time limit.

`RewardScorer` runs the reward function in an `IsolatedPool` (`streamrl.isolation.pool`) of
`workers` spawned processes. A reward function is user code over model output: it may raise,
return garbage, loop forever or crash its interpreter. None of that raises in the caller: such
a call scores 0.0, is marked failed in the batch's `Scores` (so the caller can drop the group
instead of training on it as wrong; `generator.reward.on_error`), is counted in
`RewardScorer.stats` and is logged.

The pool keeps the limits (its module docstring says how): a call's deadline is `timeout_s`
after it starts in a worker; a call past it, and every call in flight when a worker dies, fails
and the workers are replaced; calls still within their limit run again (rewards are pure
functions). Each worker is boxed in — no credentials in its environment, an address-space limit
of `memory_mb`, the OOM killer's first choice, dead with its parent — and only then imports the
reward (`streamrl.isolation.worker`): a user's module is imported nowhere else, so the caller
only checks the name (`check_reward_name`).

How loading is kept in bounds. The workers count as started once every one has loaded the
reward, within `startup_timeout_s`. On entry a failure raises: `RewardResolutionError` for a
module or function that is not there (in the same words as `resolve_reward`), `RewardLoadError`
for a module that raised on import, an import still running at the limit (its workers are
killed) or a worker that died starting. A replacement pool that fails to start (the import
hangs now) does not raise: the calls waiting for it score 0.0 as errors, counted, and the next
batch tries again.

`score()` may be called from several threads; their calls share the workers, queued in the
order submitted. Scores are raw, in [0, 1]; `streamrl.algorithms.shaping.scale_rule_reward`
maps them to the rule reward (±1 or 1/0) in the generator.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from streamrl.isolation.pool import Failure, IsolatedPool, Outcome
from streamrl.isolation.worker import STARTUP_TIMEOUT_S
from streamrl.rewards.registry import (
    RewardLoadError,
    RewardResolutionError,
    RewardSpec,
    check_reward_name,
    resolve_reward,
)
from streamrl.rewards.worker import RewardValueError, call_reward

if TYPE_CHECKING:
    from streamrl.rewards.config import RewardConfig

__all__ = [
    "Failure",
    "RewardLoadError",
    "RewardScorer",
    "Score",
    "Scores",
    "ScoringStats",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Score:
    """One response's outcome: `value` in [0, 1] (0.0 when the call failed), and `failure`:
    None when the reward scored it, else "error" or "timeout" (as in `Scores`), `error` saying
    how it failed."""

    value: float
    failure: Failure | None = None
    error: str = ""


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
        fn: str | RewardSpec,
        *,
        workers: int = 2,
        timeout_s: float = 10.0,
        memory_mb: int = 4096,
        nice: int = 0,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        failed_call_outcome: str = "it scores 0.0, marked failed",
    ) -> None:
        """`failed_call_outcome`: what becomes of a response whose call failed, for the
        warning (`RewardConfig.failed_call_outcome` in a generator)."""
        if workers < 1:
            raise ValueError(f"workers must be ≥ 1, got {workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if memory_mb < 1:
            raise ValueError(f"memory_mb must be ≥ 1, got {memory_mb}")
        if not startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s}")
        spec = fn if isinstance(fn, RewardSpec) else RewardSpec(fn, timeout_s=timeout_s)
        check_reward_name(spec.fn)  # unknown names and malformed paths fail here, in the caller
        self.fn = spec.fn
        self.workers = workers
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.startup_timeout_s = startup_timeout_s
        self.failed_call_outcome = failed_call_outcome
        self._pool = IsolatedPool(
            resolve_reward,
            spec,
            subject=f"reward {spec.fn!r}",
            setting="generator.reward",
            workers=workers,
            memory_mb=memory_mb,
            nice=nice,
            startup_timeout_s=startup_timeout_s,
            resolution_error=RewardResolutionError,
            load_error=RewardLoadError,
        )
        self._counts = ScoringStats()
        self._counts_lock = threading.Lock()
        self._tracebacks_logged: set[str] = set()

    @classmethod
    def from_config(cls, config: RewardConfig) -> RewardScorer:
        """A scorer for `generator.reward`."""
        return cls(
            config.spec(),
            workers=config.workers,
            timeout_s=config.timeout_s,
            memory_mb=config.memory_mb,
            nice=config.nice,
            startup_timeout_s=config.startup_timeout_s,
            failed_call_outcome=config.failed_call_outcome,
        )

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (they change when a pool is replaced)."""
        return self._pool.worker_pids

    @property
    def stats(self) -> ScoringStats:
        """A snapshot of the counters (`ScoringStats`)."""
        with self._counts_lock:
            counts = dataclasses.replace(self._counts)
        counts.pool_restarts, counts.failed_starts = self._pool.restarts, self._pool.failed_starts
        return counts

    def __enter__(self) -> RewardScorer:
        self._pool.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers, after the batches other threads are scoring have finished."""
        self._pool.close()

    def submit(self, response: str, ground_truth: str, prompt: str | None = None) -> Future[Score]:
        """Score one response in a worker; the future never raises for what the reward did (a
        failed call is counted, logged and scores 0.0: `Score.failure`)."""
        if not self._pool.is_open:
            raise RuntimeError(
                "RewardScorer is not open; use it as `with RewardScorer(...) as scorer:`"
            )
        outcome = self._pool.submit(
            call_reward, response, ground_truth, prompt, timeout_s=self.timeout_s
        )
        score: Future[Score] = Future()

        def done(future: Future[Outcome]) -> None:
            outcome = future.result()
            with self._counts_lock:
                self._counts.calls += 1
            if outcome.failure is None:
                score.set_result(Score(outcome.value))
            else:
                score.set_result(Score(0.0, *self._count(response, outcome)))

        outcome.add_done_callback(done)
        return score

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
        given: list[str | None] = [None] * len(responses) if prompts is None else list(prompts)
        futures = [
            self.submit(response, truth, prompt)
            for response, truth, prompt in zip(responses, ground_truths, given, strict=True)
        ]
        scores = [future.result() for future in futures]
        return Scores([s.value for s in scores], [s.failure for s in scores])

    def _count(self, response: str, outcome: Outcome) -> tuple[Failure, str]:
        """Count and log a failed call; how it failed, in words. An exception's (remote)
        traceback is logged for the first failure of its type, its one-line form for every
        one."""
        assert outcome.failure is not None
        with self._counts_lock:
            if outcome.failure == "timeout":
                self._counts.timeouts += 1
            else:
                self._counts.errors += 1
        if outcome.failure == "timeout":
            log.warning(
                "reward %r exceeded timeout_s=%.3g on response %s; its worker was killed and "
                "the call failed: %s. Raise generator.reward.timeout_s if such calls are "
                "legitimately slow.",
                self.fn, self.timeout_s, _preview(response), self.failed_call_outcome,
            )  # fmt: skip
            return "timeout", outcome.reason
        exc, what = outcome.exception, outcome.reason
        with_traceback = False
        if isinstance(exc, RewardValueError):
            what, exc = str(exc), None
        elif exc is not None:
            kind = type(exc).__name__
            with self._counts_lock:
                with_traceback = kind not in self._tracebacks_logged
                self._tracebacks_logged.add(kind)
            what = f"{what} {kind}: {exc}"
        log.warning(
            "reward %r failed on response %s: %s; %s",
            self.fn, _preview(response), what, self.failed_call_outcome,
            exc_info=exc if with_traceback else None,
        )  # fmt: skip
        return "error", what


def _preview(response: str, limit: int = 60) -> str:
    text = response if len(response) <= limit else "…" + response[-limit:]
    return repr(text)
