"""The learner's side of the replay stream: reading it, choosing each batch, saying where it is.

Consumes: the run's replay stream from the cursor of the learner's `TrainingState` (read on rank
0 only, by a `StreamReader`); segments whose commit record shows only groups too stale to train
on are not read (`StreamReader.oldest_usable_version`), only counted.
Produces: each step's `StreamBatch` (B accepted groups, chosen by a `BatchCollector` on rank 0
and handed to every rank, so ranks can never train on different data or disagree about an
error) with the stream's metrics (`stream/quarantined*`, `stream/read_retries_total`,
`generators/paused_s_total`, `generators/cpu_s_total`); the learner's progress record
`<run>/control/learner.json` (`storage.stream.learner_progress`) after each step and, while it
waits for groups mid-step, a `waiting` one at the reader's cursor; both carry the groups in a
row without signal that dynamic sampling dropped (`BatchCollector.no_signal`), so a starved
learner shows in storage.
Waits for: B accepted groups; `stream_timeout_s` without a new group is a `StreamTimeoutError`
naming the cursor, the step and the fix, raised on every rank. `while_waiting` is called on
each idle wait: raising there (a weight version that failed for good, a lost lease) ends it.
A long wait for the first batch is said on the terminal (`streamrl.learner.first_batch`).

Every record it writes is checked against the run's lease first (`storage.control.lease`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

from storage.control.lease import RunLease
from storage.control.progress import read_all_progress
from storage.fs import Location
from storage.stream.learner_progress import LearnerProgress, write_learner_progress
from storage.stream.reader import SkippedSegment
from storage.stream.records import Cursor, ScoredGroup
from storage.stream.writer import StreamReader, StreamTimeoutError, quarantined
from streamrl.config.run import RunConfig
from streamrl.learner.batching import BatchCollector, FilterCounts, StreamBatch
from streamrl.learner.checkpointing import TrainingState
from streamrl.learner.first_batch import FirstBatchWait
from streamrl.learner.topology import Topology

__all__ = ["StopRequested", "StreamSource"]

log = logging.getLogger(__name__)


class StopRequested(Exception):  # noqa: N818 (a request, not an error)
    """The learner was asked to stop (SIGTERM, Ctrl-C): raised by `while_waiting` to abandon
    the wait for a batch; `next_batch` then returns None on every rank."""


class StreamSource:
    """One learner's stream (see the module docstring). `next_batch` is a collective: every
    rank calls it; only rank 0 holds the `reader` and `collector` (None elsewhere) and writes
    the progress records. `state` is the learner's, read live: its version never decreases."""

    def __init__(
        self,
        config: RunConfig,
        run: Location,
        topology: Topology,
        state: TrainingState,
        *,
        vocab_size: int,
        lease: RunLease | None,
        while_waiting: Callable[[], None],
    ) -> None:
        self.run, self.topology, self.state, self.lease = run, topology, state, lease
        self._while_waiting = while_waiting
        self._progress: LearnerProgress | None = None  # as last written (rank 0)
        self._progress_lock = threading.Lock()  # the reader's prefetch thread writes it too
        self.reader: StreamReader | None = None
        self.collector: BatchCollector | None = None
        self._groups: Iterator[ScoredGroup | SkippedSegment] | None = None
        self._first_batch = FirstBatchWait(config.learner.batch_groups, state.step + 1)
        if not topology.is_main:
            return
        cfg = config.learner
        self.collector = collector = BatchCollector(
            batch_groups=cfg.batch_groups,
            max_staleness=cfg.max_staleness,
            dynamic_sampling=config.algorithm.dynamic_sampling,
            vocab_size=vocab_size,
            max_seq_len=config.model.max_model_len,
            totals=state.totals,
            batch_tokens=cfg.batch_tokens,
            needs_teacher=config.algorithm.opd is not None,
        )
        # Evaluated by the reader's prefetch thread ahead of the collector's own check: exact
        # because the learner's version never decreases (see storage.stream.reader).
        self.reader = StreamReader(
            run,
            state.cursor,
            oldest_usable_version=lambda: collector.oldest_usable(state.version),
            on_idle=self._report_waiting,
        )
        self._groups = self.reader.groups(timeout_s=cfg.stream_timeout_s)
        self._quarantined_before = len(quarantined(run))

    def next_batch(self) -> tuple[StreamBatch, dict[str, float]] | None:
        """The next batch and the stream's metrics, decided on rank 0 and handed to every rank
        (an error there, e.g. a stream timeout, raises on every rank); None on every rank when
        the wait for it was abandoned (`StopRequested`): nothing of it was consumed, the
        learner's cursor still points at its first group."""
        return self.topology.decide_on_main(self._collect)

    def close(self) -> None:
        """Stop reading the stream (rank 0): the reader's prefetch thread ends, and with it its
        polling of the stream and progress writes. Idempotent."""
        if self._groups is not None:
            self._groups.close()
            self._groups = None

    def _collect(self) -> tuple[StreamBatch, dict[str, float]] | None:
        reader, seen_before = self.reader, len(self.reader.stats.quarantined)
        try:
            batch = self.collector.collect(self._groups, lambda: reader.cursor, self.state.version)
            self._first_batch.collected()
        except StopRequested:
            return None
        except StreamTimeoutError as exc:
            raise StreamTimeoutError(
                f"{exc}; the learner is at step {self.state.step}. Start generators for this run "
                f"(streamrl generator --run {self.run.uri} --index 0) or raise "
                "learner.stream_timeout_s"
            ) from exc
        seen = len(reader.stats.quarantined)
        return batch, {
            "stream/quarantined": float(seen - seen_before),
            "stream/quarantined_total": float(self._quarantined_before + seen),
            "stream/read_retries_total": float(reader.stats.transient_errors),
            **self._generator_metrics(),
        }

    def _generator_metrics(self) -> dict[str, float]:
        """`generators/paused_s_total`: the seconds flow control has held generators back, and
        `generators/cpu_s_total` the CPU seconds their processes used, over every index and
        life, as of their last commits (their progress records)."""
        try:
            records = read_all_progress(self.run)
        except (OSError, ValueError) as exc:  # advisory: the next step reads them again
            log.warning("could not read the generators' progress records: %r", exc)
            return {}
        return {
            "generators/paused_s_total": sum(r.paused_s for r in records),
            "generators/cpu_s_total": sum(r.cpu_s for r in records),
        }

    def write_progress(self, batch: StreamBatch) -> None:
        """Rank 0: record where the learner stands after `batch` (one small write), which it has
        trained on."""
        if not self.topology.is_main:
            return
        progress = self._progress_record(batch.cursor_after, batch.counts, batch.totals)
        with self._progress_lock:
            self.collector.pending_accepted = 0
            self._check_lease()
            write_learner_progress(self.run, progress)
            self._progress = progress

    def _progress_record(
        self, cursor: Cursor, counts: FilterCounts, totals: FilterCounts
    ) -> LearnerProgress:
        correct, wrong = self.collector.no_signal
        return LearnerProgress(
            step=self.state.step,
            policy_version=self.state.version,
            cursor=cursor,
            consumed=counts.consumed,
            accepted=counts.accepted,
            dropped_stale=counts.dropped_stale,
            consumed_total=totals.consumed,
            accepted_total=totals.accepted,
            dropped_stale_total=totals.dropped_stale,
            updated_at=time.time(),
            lease_epoch=self.lease.epoch if self.lease else 0,
            no_signal_correct=correct,
            no_signal_wrong=wrong,
        )

    def _report_waiting(self, cursor: Cursor) -> None:
        """Rank 0, whenever the reader finds nothing new (its idle hook: mid-step, or while the
        step trains): the progress record moves to `cursor` and says how many groups the next
        step holds (`pending_accepted`). Without the cursor the groups this step consumed and
        rejected would still count as the generators' backlog, and flow control could pause
        every generator while the learner waits for one more group; without the count it would
        admit a whole step's groups more at a version about to be replaced (all of them stale
        under max_staleness=0).

        Raises (ending the wait, on every rank) if `while_waiting` does (`StopRequested`: the
        wait is abandoned) or the run's lease is lost."""
        self._while_waiting()
        self._first_batch.waiting(self.collector.pending_accepted)  # a progress line, when due
        with self._progress_lock:
            self._check_lease()
            self._write_waiting(cursor)

    def _check_lease(self) -> None:
        """Rank 0, right before writing a progress record."""
        if self.lease is not None:
            self.lease.check()

    def _write_waiting(self, cursor: Cursor) -> None:
        last = self._progress
        pending, (correct, wrong) = self.collector.pending_accepted, self.collector.no_signal
        was = last and (last.pending_accepted, last.no_signal_correct, last.no_signal_wrong)
        unchanged = last is not None and last.waiting and last.cursor == cursor
        if unchanged and was == (pending, correct, wrong):
            return
        if last is None:  # before the first step of this life
            last = self._progress_record(cursor, FilterCounts(), self.collector.totals)
        progress = replace(
            last,
            cursor=cursor,
            waiting=True,
            pending_accepted=pending,
            no_signal_correct=correct,
            no_signal_wrong=wrong,
            updated_at=time.time(),
        )
        try:
            write_learner_progress(self.run, progress)
        except OSError as exc:  # advisory: the next step's record replaces it
            log.warning("could not record the learner's stream position: %r", exc)
            return
        self._progress = progress
