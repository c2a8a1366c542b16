"""The learner loop: stream in, weights and checkpoints out.

Consumes: the run's replay stream, from the cursor of the latest committed checkpoint.
Produces: a weight version every `publish_every` steps (each rank uploads its shard in the
background while the next step trains: `streamrl.learner.publish`), a checkpoint
every `checkpoint_every` steps and at the end (model, optimiser, step, policy version, stream
cursor, filter totals, RNG), one JSON line of metrics per step in `<run>/metrics/learner.jsonl`,
its progress after each step in `<run>/control/learner.json` (cursor, version, groups consumed
and accepted: `storage.learner_progress`), and the run's stop marker when `total_steps` is
reached. Segments whose commit record shows only groups too stale to train on are not read
(`StreamReader.oldest_usable_version`), only counted. Rank 0 checks each step's metrics for
the health conditions (`streamrl.health`): one that becomes true is logged as a warning and
recorded in the step's metrics as `health`.
Waits for: B accepted groups; the stream reader blocks, and `stream_timeout_s` without a new
group is an error naming the cursor. Only rank 0 reads the stream: it decides which groups form
the batch (and whether the stream timed out) and hands the batch to every rank, so ranks can
never train on different data or disagree about an error.

An optimiser update with a non-finite gradient norm is skipped and counted; after
`max_skipped_updates` in a row the learner fails (nothing of the diverged state is published:
the weight store also refuses NaN/inf tensors).

Models: the policy; for a KL term a reference policy (frozen initial weights, or an EMA of the
policy that is checkpointed); for VAPO a critic with its own optimiser, pre-trained on the
frozen policy's responses (`value_pretrain_steps` batches, or until explained variance reaches
`value_pretrain_target_ev`) before the first policy update, then checkpointed at step 0.

One learner per run: rank 0 holds the run's lease (`storage.lease`) from before it loads a
checkpoint until it ends; every checkpoint, weight commit, LATEST move, retention deletion and
progress or metrics record is written only after checking it still holds it (a collective
check before each step's writes), and a learner that lost it (`LeaseLostError`) stops without
writing anything more. A weight version that could not be committed fails the learner
(`PublishFailedError`, see `streamrl.learner.publish`), also while it waits for data.

Resume is exact: parameters, optimiser, version, cursor and RNG come from the checkpoint, and a
weight version that an earlier life already published is not published again (the same steps
on the same stream produce the same weights). A checkpoint written for other models (another
architecture, algorithm family, critic or reference) is refused before anything is loaded or
written, naming the differences.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any

import torch

from storage.control import request_stop
from storage.fs import Location, StorageError
from storage.learner_progress import LearnerProgress, write_learner_progress
from storage.lease import RunLease
from storage.progress import read_all_progress
from storage.records import Cursor
from storage.stream import StreamReader, StreamTimeoutError, quarantined
from storage.weights import WeightStore
from streamrl.config import RunConfig
from streamrl.health import HealthMonitor
from streamrl.learner.batching import (
    BatchCollector,
    FilterCounts,
    StreamBatch,
    TrainBatch,
    make_mini_batches,
)
from streamrl.learner.checkpointing import IncompatibleCheckpointError, LearnerCheckpoints
from streamrl.learner.loading import build_step_models
from streamrl.learner.publish import WeightPublisher
from streamrl.learner.reporting import MetricsReporter, read_metrics
from streamrl.learner.step import StepSettings, train_on_batch
from streamrl.learner.topology import Topology

__all__ = ["DivergedError", "IncompatibleCheckpointError", "Learner"]


class DivergedError(RuntimeError):
    """Too many optimiser updates in a row had a non-finite gradient norm."""


log = logging.getLogger(__name__)


class Learner:
    """One learner process (a rank of the torchrun job); `run()` trains to `total_steps`."""

    def __init__(
        self, config: RunConfig, run: Location, topology: Topology, *, take_over: bool = False
    ) -> None:
        """Take the run's lease (rank 0; `take_over`: even from a live holder, see
        `storage.lease`), build the models and resume from the latest checkpoint."""
        self.config, self.run_location, self.topology = config, run, topology
        self.lease: RunLease | None = None
        topology.decide_on_main(lambda: self._acquire_lease(take_over))
        try:
            self._setup()
        except BaseException:
            self.release()
            raise

    def _acquire_lease(self, take_over: bool) -> None:
        self.lease = RunLease.acquire(
            self.run_location, ttl_s=self.config.learner.lease_ttl_s, take_over=take_over
        )

    def release(self) -> None:
        """Give the run's lease up (rank 0): a successor may start at once."""
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def _setup(self) -> None:
        config, run, topology = self.config, self.run_location, self.topology
        cfg, algorithm = config.learner, config.algorithm
        self.models, self.shared_prompt = build_step_models(config, topology)
        self.vocab_size = self.models.policy.model.config.vocab_size
        self.weights = WeightStore(run, fence=self.lease)
        self.publisher = WeightPublisher(
            self.weights,
            topology,
            config.weights,
            getattr(torch, config.weights.resolved_dtype(config.model)),
        )
        self.checkpoints = LearnerCheckpoints(config, run, topology, self.models, self.lease)
        self.settings = StepSettings.from_config(config)
        self.step, self.version, cursor, totals = 0, 0, Cursor(), FilterCounts()
        self.value_pretrained = not algorithm.uses_value_model
        if (resumed := self.checkpoints.resume()) is not None:
            self.step, self.version = resumed.step, resumed.version
            cursor, totals = resumed.cursor, resumed.totals
            self.value_pretrained = resumed.value_pretrained
            log.info("resumed at step %d, version %d, stream %s", self.step, self.version, cursor)
        self.reporter = MetricsReporter(
            run,
            config.logging,
            config=config.model_dump(mode="json"),
            total_steps=cfg.total_steps,
            start_step=self.step,
            enabled=topology.is_main,
        )
        self.health = self._health_monitor() if topology.is_main else None
        self._progress: LearnerProgress | None = None  # as last written (rank 0)
        self._progress_lock = threading.Lock()  # the reader's prefetch thread writes it too
        # The stream is read on rank 0 only (see `_collect`).
        self.reader: StreamReader | None = None
        self.collector: BatchCollector | None = None
        if topology.is_main:
            collector = BatchCollector(
                batch_groups=cfg.batch_groups,
                max_staleness=cfg.max_staleness,
                dynamic_sampling=algorithm.dynamic_sampling,
                vocab_size=self.vocab_size,
                max_seq_len=config.model.max_model_len,
                totals=totals,
            )
            # Evaluated by the reader's prefetch thread ahead of the collector's own check:
            # exact because self.version never decreases (see storage.stream_reader).
            self.reader = StreamReader(
                run,
                cursor,
                oldest_usable_version=lambda: collector.oldest_usable(self.version),
                on_idle=self._report_waiting,
            )
            self.collector = collector
            self._groups = self.reader.groups(timeout_s=cfg.stream_timeout_s)
            self._quarantined_before = len(quarantined(run))

    def _health_monitor(self) -> HealthMonitor:
        """Rank 0's health conditions; a resumed learner's baselines and windows carry on from
        the run's records of the steps up to its checkpoint."""
        config = self.config
        monitor = HealthMonitor(
            config.health,
            max_tokens=config.generator.max_tokens,
            max_staleness=config.learner.max_staleness,
        )
        if self.step > 0:
            try:
                records = read_metrics(self.run_location)
            except (OSError, StorageError) as exc:  # advisory: only the baselines start afresh
                log.warning(
                    "could not read the run's metrics; health baselines start afresh: %r", exc
                )
            else:
                monitor.seed(r for r in records if r.get("step", 0) <= self.step)
        return monitor

    def run(self) -> int:
        """Train until `total_steps`, then checkpoint, publish and stop the generators; the
        run's lease is released at the end (also on an error)."""
        cfg = self.config.learner
        try:
            with self.reporter:
                if not self.value_pretrained:
                    self.pretrain_value()
                while self.step < cfg.total_steps:
                    self.train_step()
            self.publisher.flush()  # the last version is committed before the generators stop
            self._guard()
            if self.topology.is_main:
                request_stop(self.run_location, f"learner reached {cfg.total_steps} steps")
        finally:
            self.release()
        return self.step

    def _guard(self) -> None:
        """Every rank, before the learner writes the run: fail (`LeaseLostError`) if rank 0 no
        longer holds the run's lease (a collective, so every rank stops together)."""
        self.topology.decide_on_main(lambda: self.lease.check() if self.lease else None)

    def pretrain_value(self) -> list[dict[str, float]]:
        """VAPO value pre-training: critic-only steps on the frozen policy's responses until
        `value_pretrain_steps` or `value_pretrain_target_ev`; then a checkpoint at step 0.
        Returns each step's metrics. (A learner killed before that checkpoint starts over.)"""
        algorithm, history = self.config.algorithm, []
        for k in range(algorithm.value_pretrain_steps):
            batch, metrics = self._train_batch(train_policy=False)
            metrics.update({"step": self.step, "value_pretrain_step": k + 1})
            self._write_progress(batch)
            history.append(metrics)
            self.reporter.log(metrics)
            if metrics["critic/explained_var"] >= algorithm.value_pretrain_target_ev:
                break
        self.value_pretrained = True
        if history:
            self._checkpoint(batch)
        return history

    def _collect(self) -> tuple[StreamBatch, dict[str, float]]:
        """The next batch and the stream's health metrics, decided on rank 0 and handed to
        every rank (an error there, e.g. a stream timeout, raises on every rank)."""

        def on_main() -> tuple[StreamBatch, dict[str, float]]:
            reader, seen_before = self.reader, len(self.reader.stats.quarantined)
            try:
                batch = self.collector.collect(self._groups, lambda: reader.cursor, self.version)
            except StreamTimeoutError as exc:
                raise StreamTimeoutError(
                    f"{exc}; the learner is at step {self.step}. Start generators for this run "
                    f"(streamrl generator --run {self.run_location.uri} --index 0) or raise "
                    "learner.stream_timeout_s"
                ) from exc
            seen = len(reader.stats.quarantined)
            return batch, {
                "stream/quarantined": float(seen - seen_before),
                "stream/quarantined_total": float(self._quarantined_before + seen),
                "stream/read_retries_total": float(reader.stats.transient_errors),
                **self._generator_metrics(),
            }

        return self.topology.decide_on_main(on_main)

    def _generator_metrics(self) -> dict[str, float]:
        """`generators/paused_s_total`: the seconds flow control has held generators back, over
        every index and life, as of their last commits (their progress records)."""
        try:
            records = read_all_progress(self.run_location)
        except (OSError, ValueError) as exc:  # advisory: the next step reads them again
            log.warning("could not read the generators' progress records: %r", exc)
            return {}
        return {"generators/paused_s_total": sum(r.paused_s for r in records)}

    def _train_batch(self, *, train_policy: bool = True) -> tuple[StreamBatch, dict[str, float]]:
        """Collect a batch and train on it: the batch and its metrics."""
        cfg, started = self.config.learner, time.perf_counter()
        batch, stream_metrics = self._collect()
        collected = time.perf_counter()
        train = TrainBatch.from_groups(batch.groups)
        mini_batches = make_mini_batches(
            train,
            cfg.mini_batch_groups,
            cfg.micro_batch_tokens,
            overlong_filter=self.config.algorithm.overlong.filter,
            shared_prompt=self.shared_prompt,
        )
        metrics = train_on_batch(
            self.models,
            train,
            mini_batches,
            self.config.algorithm,
            self.settings,
            self.topology,
            train_policy=train_policy,
        )
        done = time.perf_counter()
        tokens = sum(m.num_loss_tokens for m in mini_batches)
        metrics.update(batch.metrics() | stream_metrics)
        metrics.update(
            {
                "perf/step_s": done - started,
                "perf/wait_s": collected - started,  # waiting for B accepted groups
                "perf/learner_tokens_per_s": tokens / max(done - collected, 1e-9),
            }
        )
        return batch, metrics

    def train_step(self) -> dict[str, Any]:
        """Collect a batch, update, then publish / checkpoint / log as scheduled."""
        cfg = self.config.learner
        batch, metrics = self._train_batch()
        self.step += 1
        self._check_health(metrics)
        self._check_skipped_updates(metrics)
        self._guard()
        if self.step % cfg.publish_every == 0:
            metrics.update(self.publisher.publish(self.models.policy.model, self.version + 1))
            self.version += 1
        if self.step % cfg.checkpoint_every == 0 or self.step == cfg.total_steps:
            self._checkpoint(batch)
        self._write_progress(batch)
        metrics.update({"step": self.step, "policy_version": self.version})
        self.reporter.log(metrics)
        return metrics

    def _write_progress(self, batch: StreamBatch) -> None:
        """Rank 0: record where the learner stands after `batch` (one small write)."""
        if not self.topology.is_main:
            return
        progress = self._progress_record(batch.cursor_after, batch.counts, batch.totals)
        with self._progress_lock:
            self._check_lease()
            write_learner_progress(self.run_location, progress)
            self._progress = progress

    def _progress_record(
        self, cursor: Cursor, counts: FilterCounts, totals: FilterCounts
    ) -> LearnerProgress:
        return LearnerProgress(
            step=self.step,
            policy_version=self.version,
            cursor=cursor,
            consumed=counts.consumed,
            accepted=counts.accepted,
            dropped_stale=counts.dropped_stale,
            consumed_total=totals.consumed,
            accepted_total=totals.accepted,
            dropped_stale_total=totals.dropped_stale,
            updated_at=time.time(),
            lease_epoch=self.lease.epoch if self.lease else 0,
        )

    def _report_waiting(self, cursor: Cursor) -> None:
        """Rank 0, while waiting for groups mid-step (the reader's idle hook): the progress
        record moves to `cursor`. Without it the groups this step consumed and rejected would
        still count as the generators' backlog, and flow control could pause every generator
        while the learner waits for one more group.

        Raises (ending the wait, on every rank) if the version in flight failed for good — no
        generator will ever produce data of it — or the run's lease is lost."""
        self.publisher.check_failed()
        with self._progress_lock:
            self._check_lease()
            self._write_waiting(cursor)

    def _check_lease(self) -> None:
        """Rank 0, right before writing a progress or metrics record."""
        if self.lease is not None:
            self.lease.check()

    def _write_waiting(self, cursor: Cursor) -> None:
        last = self._progress
        if last is not None and last.waiting and last.cursor == cursor:
            return
        if last is None:  # before the first step of this life
            totals = self.collector.totals if self.collector else FilterCounts()
            last = self._progress_record(cursor, FilterCounts(), totals)
        progress = replace(last, cursor=cursor, waiting=True, updated_at=time.time())
        try:
            write_learner_progress(self.run_location, progress)
        except OSError as exc:  # advisory: the next step's record replaces it
            log.warning("could not record the learner's stream position: %r", exc)
            return
        self._progress = progress

    def _check_health(self, metrics: dict[str, Any]) -> None:
        """Rank 0: log each health condition this step set off, and record them as
        `metrics["health"]` (a list of `HealthEvent.as_record()`; absent when none)."""
        if self.health is None:
            return
        events = self.health.check({**metrics, "step": self.step})
        for event in events:
            log.warning(event.message)
        if events:
            metrics["health"] = [event.as_record() for event in events]

    def _check_skipped_updates(self, metrics: dict[str, float]) -> None:
        """Warn about skipped updates; fail once `max_skipped_updates` came in a row."""
        limit = self.config.learner.max_skipped_updates
        for name, part in self.models.trainables().items():
            skipped = int(metrics.get(f"{name}/skipped_updates", 0))
            if not skipped:
                continue
            log.warning(
                "step %d: skipped %d %s update(s): the gradient norm is %s (%d in a row, %d in "
                "all; the learner stops at %d in a row)",
                self.step, skipped, name, metrics[f"{name}/grad_norm"], part.skipped_in_a_row,
                part.skipped_total, limit,
            )  # fmt: skip
            if part.skipped_in_a_row >= limit:
                metrics.update({"step": self.step, "policy_version": self.version})
                self.reporter.log(metrics)
                raise DivergedError(
                    f"step {self.step}: the last {part.skipped_in_a_row} {name} optimiser "
                    "updates all had a non-finite gradient norm (NaN/inf), so none was applied "
                    f"(learner.max_skipped_updates={limit}). Training has diverged or the data "
                    "holds extreme values: lower learner.lr (and keep learner.grad_clip set), "
                    "check the rewards in the stream, then resume from the last checkpoint "
                    "(nothing diverged was published or checkpointed)"
                )

    def _checkpoint(self, batch: StreamBatch) -> None:
        # A checkpoint at version v implies v is committed: flush raises if it was not.
        self.publisher.flush()
        self._guard()
        self.checkpoints.save(
            self.step, self.version, batch, value_pretrained=self.value_pretrained
        )
