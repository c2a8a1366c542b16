"""Flow control: a generator admits a new prompt only while the learner can still train on it.

AReaL's admission rule (Fu et al., 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning
System for Language Reasoning"), for a fleet that shares nothing but storage: the learner writes its
progress after every step (`storage.stream.learner_progress`), the commit log says what the fleet
has committed, and each generator decides alone.

The rule. A group sampled now with weights version v_g can be trained on until the learner's
version exceeds v_g + S (S = `learner.max_staleness`), i.e. while the learner is at one of the
S + 1 − (V − v_g) versions V, ..., v_g + S, V being its version now. The learner publishes a
version every K = `learner.publish_every` steps and consumes about B / a groups a step
(B = `learner.batch_groups` accepted groups per step, or with `learner.batch_tokens` the mean
so far: `groups_per_step`; a = accepted / (consumed − dropped stale), the run's measured
dynamic-sampling accept rate). Stale drops are left out of a: a group admitted by this rule is
trained on before it is too stale, and counting the drops of groups admitted earlier (or by
other generators) would raise the capacity exactly when the fleet is producing too much.
The learner has already taken some of what version V trains on: n × B groups in the n = step
mod K steps since it published V, and p = `pending_accepted` groups of its next step (collected
so far, or all B while it trains on them). So before a group sampled now is too stale the
learner consumes

    capacity = ((S + 1 − (V − v_g)) × K × B − n × B − p) / a    groups,

and a prompt is admitted while

    backlog + uncommitted < capacity,

where backlog = the groups the fleet committed at or after the learner's cursor (committed, not
yet consumed) and uncommitted = this generator's own groups not yet committed (prompts in the
engine, finished groups being scored, groups in its open segment).

Approximations, all of them bounded:
  * other generators' uncommitted groups are not seen: each may overshoot by its own
    2 × `prompts_in_flight` (sampling, and waiting for scores) + `segment_groups` (the fleet by
    their sum);
  * the learner's record and the log are read at most every `REFRESH_S` (our own commits are
    added as they happen): consumption is seen late (a pause lasts up to that much longer), other
    generators' commits too (we admit a little more);
  * p moves with the cursor, in the same record (rewritten whenever the learner's reader finds
    nothing new): groups the learner took since its last record still count in the backlog
    instead;
  * a is the run's average so far, floored at `MIN_ACCEPT_RATE`; 1 before the learner consumed
    anything. Before the learner's first step (no record) it stands at cursor 0, version 0;
  * V − v_g is taken ≥ 0: the record may lag behind weights the generator already loaded.
"""

from __future__ import annotations

import logging
import time

from storage.fs import Location
from storage.stream.learner_progress import LearnerProgress, read_learner_progress
from storage.stream.log import fetch_records, first_free
from storage.stream.records import Cursor
from streamrl.learner.config import LearnerConfig

__all__ = [
    "MIN_ACCEPT_RATE",
    "REFRESH_S",
    "FlowGate",
    "accept_rate",
    "admission_capacity",
    "groups_per_step",
]

log = logging.getLogger(__name__)

REFRESH_S = 1.0  # how often the learner's record and the new commit records are read
MIN_ACCEPT_RATE = 0.05  # a learner rejecting nearly everything still bounds the backlog
LOG_BATCH = 64  # commit records read in one round


def accept_rate(progress: LearnerProgress | None) -> float:
    """Accepted / (consumed − dropped stale) groups over the run so far: the share of fresh
    groups the learner trains on (dynamic sampling rejects the rest), floored at
    `MIN_ACCEPT_RATE`; 1 before the learner consumed a fresh group."""
    if progress is None:
        return 1.0
    fresh = progress.consumed_total - progress.dropped_stale_total
    if fresh == 0:
        return 1.0
    return max(progress.accepted_total / fresh, MIN_ACCEPT_RATE)


def groups_per_step(progress: LearnerProgress | None, learner: LearnerConfig) -> float:
    """B, the accepted groups a learner step trains on: `batch_groups`; with length-aware
    batches (`batch_tokens`) the run's mean so far, at most `batch_groups` (a mean that counts
    VAPO's value pre-training batches too runs high: the cap bounds it)."""
    if learner.batch_tokens is None or progress is None or progress.step == 0:
        return float(learner.batch_groups)
    return min(float(learner.batch_groups), max(progress.accepted_total / progress.step, 1.0))


def admission_capacity(
    *,
    max_staleness: int,
    publish_every: int,
    batch_groups: int,
    learner_version: int,
    generator_version: int,
    accept_rate: float,
    steps_since_publish: int = 0,
    pending_accepted: int = 0,
) -> float:
    """Groups the learner will consume before a group sampled now with weights
    `generator_version` exceeds `max_staleness`: ((S + 1 − lag) × K × B − n × B − p) / a,
    lag = V − v_g taken ≥ 0, n the steps since V was published, p the groups accepted for the
    next step; ≤ 0 when such a group would already be too stale."""
    lag = max(learner_version - generator_version, 0)
    usable = (max_staleness + 1 - lag) * publish_every * batch_groups
    taken = steps_since_publish * batch_groups + pending_accepted
    return (usable - taken) / accept_rate


class FlowGate:
    """One generator's admission decision (`admits`), refreshed from storage at most every
    `REFRESH_S`, and how long it has refused (`paused_s`). With `enabled=False` it always
    admits."""

    def __init__(
        self, run: Location, learner: LearnerConfig, generator_id: str, *, enabled: bool = True
    ) -> None:
        self.run = run
        self.learner = learner
        self.generator_id = generator_id
        self.enabled = enabled
        self.progress: LearnerProgress | None = None
        self.backlog = 0  # groups committed at or after the learner's cursor
        self.failed_refreshes = 0
        self._groups_by_seq: dict[int, int] = {}  # commit records at or after the cursor
        self._first_seq = 0  # the learner's cursor at the last refresh
        self._log_end = 0  # the first log number not read yet
        self._next_refresh = 0.0
        self._paused_since: float | None = None
        self._paused_before = 0.0

    @property
    def paused(self) -> bool:
        return self._paused_since is not None

    @property
    def paused_s(self) -> float:
        """Seconds the gate has refused admission, the current pause included."""
        current = 0.0 if self._paused_since is None else time.monotonic() - self._paused_since
        return self._paused_before + current

    def capacity(self, generator_version: int) -> float:
        progress = self.progress or LearnerProgress(step=0, policy_version=0)
        return admission_capacity(
            max_staleness=self.learner.max_staleness,
            publish_every=self.learner.publish_every,
            batch_groups=groups_per_step(self.progress, self.learner),
            learner_version=progress.policy_version,
            generator_version=generator_version,
            accept_rate=accept_rate(self.progress),
            steps_since_publish=progress.step % self.learner.publish_every,
            pending_accepted=progress.pending_accepted,
        )

    def admits(self, generator_version: int, uncommitted: int) -> bool:
        """Whether one more prompt, sampled with weights `generator_version`, can still be
        trained on, given this generator's `uncommitted` groups."""
        if not self.enabled:
            return True
        if time.monotonic() >= self._next_refresh:
            self.refresh()
        capacity = self.capacity(generator_version)
        admitted = self.backlog + uncommitted < capacity
        if admitted != (not self.paused):
            self._switch(admitted, generator_version, uncommitted, capacity)
        return admitted

    def committed(self, groups: int) -> None:
        """This generator committed `groups`: in the backlog from now, before the next refresh
        reads its record."""
        self.backlog += groups

    def refresh(self) -> None:
        """Read the learner's progress and the commit records after its cursor (only those
        not read before). A failed read keeps the previous state (counted, logged)."""
        self._next_refresh = time.monotonic() + REFRESH_S
        try:
            progress = read_learner_progress(self.run)
            cursor = Cursor() if progress is None else progress.cursor
            if cursor.seq < self._first_seq:  # a resumed learner went back: read again
                self._groups_by_seq.clear()
                self._log_end = cursor.seq
            self._first_seq = cursor.seq
            for seq in [s for s in self._groups_by_seq if s < cursor.seq]:
                del self._groups_by_seq[seq]
            self._read_new_records(start=max(self._log_end, cursor.seq))
        except OSError as exc:  # storage unreachable for now: decide on what we saw last
            self.failed_refreshes += 1
            log.warning("generator %s: flow control could not read the learner's progress or "
                        "the commit log (%d failures so far): %r",
                        self.generator_id, self.failed_refreshes, exc)  # fmt: skip
            return
        self.progress = progress
        self.backlog = max(sum(self._groups_by_seq.values()) - cursor.offset, 0)

    def _read_new_records(self, start: int) -> None:
        """The commit records from `start` to the end of the log: one existence check when
        there is none (the common case, every `REFRESH_S`), then `LOG_BATCH` records a round."""
        stream = self.run.child("stream")
        end = first_free(stream, start)
        while start < end:
            records = fetch_records(stream, start, min(end - start, LOG_BATCH))
            if not records:
                break
            for record in records:
                self._groups_by_seq[record.seq] = record.num_groups
            start = self._log_end = records[-1].seq + 1

    def _switch(
        self, admitted: bool, generator_version: int, uncommitted: int, capacity: float
    ) -> None:
        now = time.monotonic()
        version = 0 if self.progress is None else self.progress.policy_version
        if admitted:
            assert self._paused_since is not None
            paused = now - self._paused_since
            self._paused_before += paused
            self._paused_since = None
            log.info("generator %s: flow control resumes after %.1fs: %d groups not consumed + "
                     "%d uncommitted < %.1f usable (learner v%d, weights v%d)",
                     self.generator_id, paused, self.backlog, uncommitted, capacity, version,
                     generator_version)  # fmt: skip
        else:
            self._paused_since = now
            log.info("generator %s: flow control pauses: %d groups not consumed + %d "
                     "uncommitted ≥ %.1f the learner can use within max_staleness=%d "
                     "(learner v%d, weights v%d)",
                     self.generator_id, self.backlog, uncommitted, capacity,
                     self.learner.max_staleness, version, generator_version)  # fmt: skip
