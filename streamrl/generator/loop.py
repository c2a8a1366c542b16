"""The generator loop: prompts in, scored groups out, weights picked up as they are published.

Consumes: prompts from this generator's shard of the dataset, and published weight versions.
Produces: `ScoredGroup`s in the replay stream, one segment every `segment_groups` groups or
`segment_seconds` seconds, whichever comes first, and at once when flow control holds the
generator back with nothing in flight (the learner may be waiting for exactly those groups).
Every group is a rollout of the configured environment (`generator.env`; single-turn by
default), driven by `EpisodeDriver`. A group with a failed reward or environment call (raised
or timed out) is left out or trained on with score 0, per `generator.reward.on_error`; either
way the failures are counted in the next commit record.
Waits for: vLLM, and the learner only through flow control (`generator.flow_control`): a new
prompt is admitted only while the learner can still train on it within `max_staleness`
(`streamrl.generator.flow_control`); paused with nothing in flight, the loop sleeps and keeps
polling weights and the stop marker. It keeps up to `prompts_in_flight` groups sampling (in
the engine or in their environment; environment calls run in worker processes while the
engine goes on), and up to twice that many in all with the groups whose episodes have ended
and wait for their scores (reward workers): slow scoring holds sampling back only once that
many wait. Between
engine steps it polls `LATEST` every `weight_poll_s` seconds; when it moved, the engine's
workers read the newest intact version straight from the weight store and load it in place
(`Engine.advance_weights`). A corrupt version is skipped for good (counted, logged) and the
newest intact one above the current is loaded instead.
Stops when: the run's stop marker or its own (scaling in) appears, or `stop` is set (e.g. by
SIGTERM); it then scores the groups whose episodes all ended, flushes its open segment and
returns. A SIGKILL
loses at most that segment. After every commit the `PromptLedger` records how far the prompts
are committed, so a restart continues there. Fails, committing nothing more, when its index
was taken over by another generator (`before_commit`), or when the user's code fails as a
restart would fail again (`streamrl.generator.failures.UserCodeFailedError`, from the episodes).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future
from typing import Literal

from storage.control.heartbeat import Heart
from storage.control.requests import stop_requested
from storage.fs import Location
from storage.stream.writer import StreamWriter
from storage.weights.follower import Advance
from storage.weights.versions import WeightStore
from streamrl.config.run import RunConfig
from streamrl.data import PromptIterator
from streamrl.data.curriculum import Curriculum
from streamrl.envs.runner import EnvRunner
from streamrl.generator.engine import Engine, WeightSource
from streamrl.generator.flow_control import FlowGate
from streamrl.generator.progress import PromptLedger
from streamrl.generator.records import GeneratorStats, GroupRecords
from streamrl.generator.rollouts import EpisodeDriver, Rollout
from streamrl.isolation.pool import Failure
from streamrl.placement.usage import tree_cpu_s
from streamrl.rewards import Scores
from streamrl.scorers.client import ScorerCallError
from streamrl.scorers.teacher import Teacher, TeacherScores
from streamrl.scorers.terms import ModelTermScorer, TermScores, judge_counts

__all__ = ["BrokenRewardError", "GeneratorLoop"]

log = logging.getLogger(__name__)
progress_log = logging.getLogger("streamrl.progress")  # a terminal shows it (supervision.output)

MAX_FAILED_GROUPS_IN_A_ROW = 32
PAUSED_SLEEP_S = 0.25  # flow control refuses and nothing is in flight: sleep, don't spin
ENV_WAIT_S = 0.01  # every episode in flight waits for its environment: poll again soon


class BrokenRewardError(RuntimeError):
    """The reward function (or the environment) failed on every response of many groups in a
    row."""


class GeneratorLoop:
    """One generator: an engine, its prompts, an environment runner, a stream writer."""

    def __init__(
        self,
        *,
        config: RunConfig,
        run: Location,
        engine: Engine,
        prompts: PromptIterator,
        runner: EnvRunner,
        writer: StreamWriter,
        generator_id: str,
        ledger: PromptLedger | None = None,
        before_commit: Callable[[], object] | None = None,
        teacher: Teacher | None = None,
        terms: Sequence[ModelTermScorer] = (),
        curriculum: Curriculum | None = None,
    ) -> None:
        """`runner`: the environment's (`generator.env`), open. `before_commit` runs before
        every commit and raises when this generator may no longer write (its index was taken
        over: `streamrl.generator.index.GeneratorIndex.check`). `teacher`: the run's
        (`generator.teacher`), `terms`: the reward's model terms (`generator.reward.models`),
        their clients open. `curriculum`: the tasks' levels (`data.reasoning_gym.curriculum`),
        each prompt drawn at its task's level and each group counted towards it."""
        self.config = config
        self.run_location = run
        self.engine = engine
        self.prompts = prompts
        self.runner = runner
        self.episodes = EpisodeDriver(config, engine, runner, teacher, terms)
        self.writer = writer
        self.weights = WeightStore(run)
        self.weight_source = WeightSource.of(run, config.weights)
        self.generator_id = generator_id
        self.stats = GeneratorStats()
        self.records = GroupRecords(config, generator_id, self.stats)
        self.ledger = ledger or PromptLedger(prompts)
        self.before_commit = before_commit
        self.curriculum = curriculum
        self._next_key = 0
        self._corrupt_versions: set[int] = set()
        self._failed_in_a_row = 0  # groups whose every reward call failed
        self._judged = (0, 0)  # judge verdicts, unparsed ones: counted so far
        self._teacher_failed_in_a_row = 0  # groups the teacher could not score
        self._next_poll = 0.0
        self.heart = Heart(run, generator_id)  # beats from `_poll`: the loop's progress
        self._stop = threading.Event()
        self._gate = FlowGate(
            run, config.learner, generator_id, enabled=config.generator.flow_control != "off"
        )
        self._started = time.monotonic()
        self._next_log = self._started + 30.0
        self._sampled = False

    def run(self, stop: threading.Event | None = None) -> GeneratorStats:
        """Generate until stopped; flush what was scored; return the counters."""
        stop = self._stop = stop or threading.Event()
        log.info(
            "generator %s generating: %d prompts in flight, %s, weights v%d",
            self.generator_id,
            self.config.generator.prompts_in_flight,
            self.episodes.group_sizes.describe(),
            self.engine.policy_version,
        )
        while not stop.is_set():
            if self._poll_due() and self._poll():
                break
            self.step()
        self._drain()
        return self.stats

    def step(self) -> None:
        """Top up the groups in flight, advance the engine one step and the episodes as far as
        they go, and write the groups finished and scored."""
        cfg = self.config.generator
        while (
            self.episodes.groups_sampling < cfg.prompts_in_flight
            and self.episodes.groups_in_flight < 2 * cfg.prompts_in_flight  # and those scoring
            and self._admits()
        ):
            position = self.prompts.position
            key = f"g{self._next_key}"
            self._next_key += 1
            prompt = next(self.prompts)
            if self.curriculum is not None:
                prompt = self.curriculum.prompt(prompt)
            self.episodes.start(prompt, key)
            self.ledger.take(key, position)
        if self.engine.num_in_flight:
            finished = self.engine.step()
            if not self._sampled:  # the end of the start-up (benchmarks/container_bench.py)
                log.info("generator %s: first tokens sampled, weights v%d",
                         self.generator_id, self.engine.policy_version)  # fmt: skip
                self._sampled = True
        else:  # nothing to sample (paused by flow control, or waiting for environments)
            finished = []
            in_flight = self.episodes.groups_in_flight
            self._stop.wait(ENV_WAIT_S if in_flight else PAUSED_SLEEP_S)
        self._write(self.episodes.advance(finished))
        pending = self.writer.pending_groups
        held_back = self._gate.paused and not self.episodes.groups_in_flight  # no more will come
        if pending and (
            pending >= cfg.segment_groups or self.writer.pending_age_s >= cfg.segment_seconds
            or held_back
        ):  # fmt: skip
            self._flush()
        self.stats.paused_s = self._gate.paused_s
        if time.monotonic() >= self._next_log:
            self._log_throughput()

    def _admits(self) -> bool:
        """Flow control: whether the learner can still train on one more prompt."""
        uncommitted = self.episodes.groups_in_flight + self.writer.pending_groups
        return self._gate.admits(self.engine.policy_version, uncommitted)

    # -- writing -----------------------------------------------------------------------------

    def _write(self, rollouts: list[Rollout]) -> None:
        """Finished groups to the stream (or dropped, per `reward.on_error`), in the order they
        finished; the prompts of groups dropped on purpose count as collected too."""
        for rollout in rollouts:
            self.ledger.collected(rollout.key)
            scored = [f.result() for f in rollout.scores]
            terms = {name: _term_scores(futures) for name, futures in rollout.terms.items()}
            failures = [
                s.failure or next((t.failures[i] for t in terms.values() if t.failures[i]), None)
                for i, s in enumerate(scored)
            ]
            if self._dropped_for_failures(Scores([s.reward for s in scored], failures)):
                continue
            taught = self._teacher_scores(rollout)
            if taught is not False:
                group = self.records.group(rollout, scored, taught, terms or None)
                self.writer.append(group)
                if self.curriculum is not None:
                    self.curriculum.observe(group)
        while self.episodes.dropped:  # dropped on purpose: as good as collected
            self.ledger.collected(self.episodes.dropped.pop())
        self._count_judge_verdicts()

    def _count_judge_verdicts(self) -> None:
        """The judge terms' verdicts since the last count, for the next commit record."""
        verdicts, unparsed = judge_counts(self.episodes.terms)
        self.writer.count_judge_verdicts(verdicts - self._judged[0], unparsed - self._judged[1])
        self._judged = (verdicts, unparsed)

    def _dropped_for_failures(self, scores: Scores) -> bool:
        """Count a group's failed reward calls (in `stats` and the next commit record); True
        when the group is to be left out of the stream (`generator.reward.on_error`).

        Raises `BrokenRewardError` when every call of the last `MAX_FAILED_GROUPS_IN_A_ROW`
        groups failed: a reward that never scores is a bug to fix, not data to train on."""
        self._failed_in_a_row = self._failed_in_a_row + 1 if scores.all_failed else 0
        if self._failed_in_a_row >= MAX_FAILED_GROUPS_IN_A_ROW:
            env, reward = self.config.generator.env, self.config.generator.reward
            what = f"the reward function {reward.fn!r}"
            if env.multi_turn:
                what = f"the environment {env.fn!r} (or its reward {reward.fn!r})"
            if reward.models:
                what += f" or a model reward term ({', '.join(reward.models)}: their scorers' logs)"
            raise BrokenRewardError(
                f"generator {self.generator_id}: {what} failed on every response of the last "
                f"{self._failed_in_a_row} groups ({self.stats.reward_errors + scores.errors} "
                f"errors, {self.stats.reward_timeouts + scores.timeouts} timeouts so far). Its "
                "traceback is in this generator's log; fix the function (or raise "
                "generator.reward.timeout_s if it only runs out of time)"
            )
        if not scores.any_failed:
            return False
        drop = self.config.generator.reward.on_error == "drop_group"
        self.stats.reward_errors += scores.errors
        self.stats.reward_timeouts += scores.timeouts
        self.stats.dropped_groups += int(drop)
        self.writer.count_reward_failures(
            errors=scores.errors, timeouts=scores.timeouts, dropped_groups=int(drop)
        )
        return drop

    def _teacher_scores(self, rollout: Rollout) -> TeacherScores | Literal[False] | None:
        """The group's teacher log-probs; None without a teacher; False when the teacher
        failed: the group is left out (nothing stands in for log-probs) and counted as a
        failed reward call."""
        if rollout.teacher is None:
            return None
        try:
            scores = rollout.teacher.result()
            self._teacher_failed_in_a_row = 0
            return scores
        except (ScorerCallError, CancelledError) as exc:
            self._teacher_failed_in_a_row += 1
            if self._teacher_failed_in_a_row >= MAX_FAILED_GROUPS_IN_A_ROW:
                name = self.config.generator.teacher
                raise BrokenRewardError(
                    f"generator {self.generator_id}: the teacher (scorers.{name}) failed on the "
                    f"last {self._teacher_failed_in_a_row} groups, the latest: {exc}. Its log "
                    f"is logs/scorer-{name}.log when the run serves it; fix it or its "
                    f"scorers.{name} settings (timeout_s, unavailable_s, url)"
                ) from exc
            timeout = isinstance(exc, ScorerCallError) and exc.failure == "timeout"
            self.stats.reward_errors += int(not timeout)
            self.stats.reward_timeouts += int(timeout)
            self.stats.dropped_groups += 1
            self.writer.count_reward_failures(
                errors=int(not timeout), timeouts=int(timeout), dropped_groups=1
            )
            log.warning(
                "generator %s: group %s left out: the teacher could not score it (%s)",
                self.generator_id, rollout.prompt.prompt_id, exc or type(exc).__name__,
            )  # fmt: skip
            return False

    def _flush(self) -> None:
        """Commit the open segment, then record the prompts it covers as committed."""
        if self.before_commit is not None and self.writer.pending_groups:
            self.before_commit()
        record = self.writer.flush()
        if record is not None:
            self.stats.segments += 1
            levels = None if self.curriculum is None else self.curriculum.levels
            self.ledger.committed(
                paused_s=self._gate.paused_s, task_levels=levels, cpu_s=tree_cpu_s()
            )
            self._gate.committed(record.num_groups)
            if self.stats.segments == 1:  # the learner's first step needs them
                progress_log.info("first %d groups committed", record.num_groups)

    def _drain(self) -> None:
        """On stop: drop unfinished requests, finish scoring the groups whose episodes all
        ended and flush the open segment."""
        self.engine.abort_all()
        self._write(self.episodes.drain())
        self._flush()
        log.info(
            "generator %s stopped: %d groups in %d segments, weight version %d",
            self.generator_id, self.stats.groups, self.stats.segments, self.engine.policy_version,
        )  # fmt: skip

    # -- weights and control -----------------------------------------------------------------

    def _poll_due(self) -> bool:
        return time.monotonic() >= self._next_poll

    def _poll(self) -> bool:
        """Between engine steps: load newer weights; True when the run asks us to stop."""
        self._next_poll = time.monotonic() + self.config.generator.weight_poll_s
        self.heart.beat("paused" if self._gate.paused else "generating")
        if stop_requested(self.run_location, self.generator_id):
            log.info("generator %s: stop marker found", self.generator_id)
            return True
        current = self.engine.policy_version
        latest = self.weights.latest_version()
        if latest is None or latest <= current or latest in self._corrupt_versions:
            return False
        with self.heart.meanwhile(f"loading weights v{latest}"):  # minutes for a big model
            found, seconds = self.engine.advance_weights(
                self.weight_source, newer_than=current, skip=self._corrupt_versions
            )
        self.skip_unusable_weights(found)
        if found.version is not None:
            self.stats.weight_updates += 1
            self.stats.weight_update_s += seconds
            handed = self.engine.weights_from == "handoff"
            self.stats.weights_handed_off += handed
            where = " from the learner's memory" if handed else ""
            log.info("generator %s: loaded weights v%d in %.2fs%s",
                     self.generator_id, found.version, seconds, where)  # fmt: skip
        return False

    def skip_unusable_weights(self, found: Advance) -> None:
        """Count and log the versions `found` could not use: corrupt ones are never read again
        (versions are immutable), vanished ones were removed by retention."""
        for version, why in found.corrupt.items():
            self._corrupt_versions.add(version)
            self.stats.corrupt_weight_versions += 1
            log.warning("generator %s: skipping corrupt weights v%d for good: %s",
                        self.generator_id, version, why)  # fmt: skip
        for version in found.vanished:
            self.stats.weight_update_failures += 1
            log.warning("generator %s: weights v%d vanished while being read (retention)",
                        self.generator_id, version)  # fmt: skip

    def _log_throughput(self) -> None:
        elapsed = max(time.monotonic() - self._started, 1e-9)
        s = self.stats
        log.info(
            "generator %s: %.2f groups/s, %.1f tokens/s, reward mean %.3f, acc %.3f, "
            "truncated %.3f, weights v%d (%d updates, %.2fs each, %d from the learner's memory), "
            "reward timeouts %d errors %d "
            "(%d groups dropped), paused %.0fs by flow control",
            self.generator_id,
            s.groups / elapsed,
            s.tokens / elapsed,
            s.reward_sum / max(s.responses, 1),
            s.correct / max(s.responses, 1),
            s.truncated / max(s.responses, 1),
            self.engine.policy_version,
            s.weight_updates,
            s.weight_update_s / max(s.weight_updates, 1),
            s.weights_handed_off,
            s.reward_timeouts,
            s.reward_errors,
            s.dropped_groups,
            s.paused_s,
        )
        self._next_log = time.monotonic() + 30.0


def _term_scores(futures: list[Future[float]]) -> TermScores:
    """A model term's values for a group (0.0 where its call failed) and its failures."""
    values: list[float] = []
    failures: list[Failure | None] = []
    for future in futures:
        try:
            values.append(future.result())
            failures.append(None)
        except (ScorerCallError, CancelledError) as exc:
            values.append(0.0)
            failures.append(exc.failure if isinstance(exc, ScorerCallError) else "timeout")
            log.warning("a model reward term failed on a response: %s", exc or type(exc).__name__)
    return TermScores(values, failures)
