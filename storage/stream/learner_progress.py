"""Learner progress: where the learner stands in the stream, for the generators' flow control
and for anyone watching the run.

    <run>/control/learner.json    `LearnerProgress`, rewritten whole by rank 0 after each step,
                                  and while it waits for groups in the middle of one

One learner per run writes it; the object is replaced atomically (a rename locally, one PUT on
S3), so a reader sees the previous step's record or this one. It is advisory: a resumed learner
starts from its checkpoint, not from this record, and rewrites it after its first step.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from storage.fs import Location, replace_object
from storage.stream.records import Cursor

__all__ = ["LearnerProgress", "read_learner_progress", "write_learner_progress"]

LEARNER_PROGRESS = ("control", "learner.json")


@dataclass(frozen=True)
class LearnerProgress:
    """The learner after a step.

    `cursor` is the stream position after the last group the step consumed: every group
    committed before it is consumed (trained on or dropped). `policy_version` is the newest
    weight version the learner has published, i.e. the version the staleness filter measures
    against in the next step. `consumed`, `accepted` and `dropped_stale` count this step's groups
    (dropped for staleness, skipped unread or not), `*_total` every step of the run so far,
    including earlier lives of the learner (restored from its checkpoint). `waiting`: written
    between step records, whenever the learner's stream reader finds nothing new — while the
    learner waits for groups of step `step` + 1 or trains on them: `cursor` is past what it
    consumed for that step, `pending_accepted` the groups of it accepted so far (B while it
    trains), the counts are still the last step's. After a step, `pending_accepted` is 0.
    `no_signal_correct` / `no_signal_wrong`: the groups in a row, since the last one accepted,
    that dynamic sampling dropped for having no signal — every response correct / every
    response wrong — so a learner that the data starves (`streamrl.learner.batching`: no batch
    fills, no step ends) says so in storage, not only in its log; 0 in older records.

    Invariants: counts ≥ 0; accepted + dropped_stale ≤ consumed (the same for the totals); each
    total ≥ the step's count.
    """

    step: int
    policy_version: int
    cursor: Cursor = field(default_factory=Cursor)
    consumed: int = 0
    accepted: int = 0
    dropped_stale: int = 0
    consumed_total: int = 0
    accepted_total: int = 0
    dropped_stale_total: int = 0
    waiting: bool = False
    updated_at: float = 0.0
    lease_epoch: int = 0  # the writer's lease epoch (storage.control.lease); 0 in older records
    pending_accepted: int = 0  # 0 in older records
    no_signal_correct: int = 0  # 0 in older records
    no_signal_wrong: int = 0  # 0 in older records

    def __post_init__(self) -> None:
        counts = [
            self.step,
            self.policy_version,
            self.consumed,
            self.accepted,
            self.dropped_stale,
            self.consumed_total,
            self.accepted_total,
            self.dropped_stale_total,
            self.lease_epoch,
            self.pending_accepted,
            self.no_signal_correct,
            self.no_signal_wrong,
        ]
        if min(counts) < 0:
            raise ValueError(f"learner progress {self}: steps, versions and counts are ≥ 0")
        step_ok = self.accepted + self.dropped_stale <= self.consumed
        total_ok = self.accepted_total + self.dropped_stale_total <= self.consumed_total
        if not (step_ok and total_ok):
            raise ValueError(f"learner progress {self}: accepted + dropped_stale ≤ consumed")
        below = (
            self.consumed_total < self.consumed
            or self.accepted_total < self.accepted
            or self.dropped_stale_total < self.dropped_stale
        )
        if below:
            raise ValueError(f"learner progress {self}: a total is below the step's count")

    def to_json(self) -> bytes:
        return json.dumps({**asdict(self), "cursor": self.cursor.to_dict()}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> LearnerProgress:
        try:
            raw = json.loads(data)
            return cls(**{**raw, "cursor": Cursor.from_dict(raw["cursor"])})
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(f"learner progress record is unreadable: {exc}") from None


def read_learner_progress(run: Location) -> LearnerProgress | None:
    """The learner's progress after its last step, or None before its first step."""
    try:
        return LearnerProgress.from_json(run.fs.cat_file(run.join(*LEARNER_PROGRESS)))
    except FileNotFoundError:
        return None


def write_learner_progress(run: Location, progress: LearnerProgress) -> None:
    """Replace the learner's progress record (atomically; one small PUT on S3)."""
    replace_object(run, run.join(*LEARNER_PROGRESS), progress.to_json())
