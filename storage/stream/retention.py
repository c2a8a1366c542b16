"""Releasing replay-stream segments the learner has consumed (`storage.stream_retention`).

By default (`keep`) a run keeps every segment: the stream is the audit trail of what was
trained on. With `consumed`, after each committed checkpoint the learner deletes the segment
folders of the commit records wholly before the *oldest* stream cursor of the committed
checkpoints still stored (`oldest_resume_cursor`), so resuming from any of them still reads
every group it needs. A segment a cursor is inside (cursor offset > 0) is kept. The commit
records themselves stay: a few hundred bytes each, they still say what every segment held
(writer, policy versions, rollout sums).

What was released is recorded in `<run>/stream/retention.json` (`StreamRetention`). A reader
asked to start before the released point refuses with `ReleasedStreamError` instead of waiting
for, then quarantining, segments that are gone (`StreamReader.groups`). Only the learner's own
position is protected: another reader of the stream (an audit, an export) needs `keep`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from storage.fs import Location, replace_object
from storage.stream.log import fetch_records
from storage.stream.records import Cursor

if TYPE_CHECKING:
    from storage.checkpoints.dcp import CheckpointStore
    from storage.control.fencing import Fence

log = logging.getLogger(__name__)

_DELETE_BATCH = 64  # commit records read, and their segments deleted, per fence check

__all__ = [
    "ReleasedStreamError",
    "StreamRetention",
    "check_not_released",
    "oldest_resume_cursor",
    "read_retention",
    "release_consumed",
]


class ReleasedStreamError(RuntimeError):
    """A reader was asked to start where the stream's segments have been deleted."""


@dataclass(frozen=True)
class StreamRetention:
    """`<run>/stream/retention.json`: how far the stream's segments have been released.

    Invariants: 0 ≤ `deleted_before_seq` ≤ `released_before_seq`, and neither ever decreases.
    * The segment of every commit record with seq ≥ `released_before_seq` is kept: a reader
      may start there, and nowhere before (`check_not_released`).
    * The segment of every commit record with seq < `deleted_before_seq` is deleted.
    * Those in between are being deleted: a release that stopped part-way (a crash, a storage
      error) is finished by the next one.
    Commit records are never deleted. No file means nothing was released.
    """

    released_before_seq: int = 0
    deleted_before_seq: int = 0

    def __post_init__(self) -> None:
        for value in (self.released_before_seq, self.deleted_before_seq):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"stream retention log numbers must be integers, got {value!r}")
        if not 0 <= self.deleted_before_seq <= self.released_before_seq:
            raise ValueError(
                f"stream retention must have 0 ≤ deleted_before_seq ({self.deleted_before_seq})"
                f" ≤ released_before_seq ({self.released_before_seq})"
            )


def _path(run: Location) -> str:
    return run.join("stream", "retention.json")


def read_retention(run: Location) -> StreamRetention:
    """The run's `StreamRetention` (all zero when nothing was ever released)."""
    try:
        data = run.fs.cat_file(_path(run))
    except FileNotFoundError:
        return StreamRetention()
    return StreamRetention(**json.loads(data))


def _write_retention(run: Location, retention: StreamRetention) -> None:
    replace_object(run, _path(run), json.dumps(asdict(retention)).encode())


def check_not_released(run: Location, cursor: Cursor) -> None:
    """Raise `ReleasedStreamError` if reading from `cursor` needs a released segment."""
    released = read_retention(run).released_before_seq
    if cursor.seq < released:
        raise ReleasedStreamError(
            f"cannot read {run.child('stream').uri} from cursor {cursor.seq}:{cursor.offset}: "
            f"the segments of log numbers below {released} were deleted as consumed "
            f"(storage.stream_retention=consumed; {_path(run)}). Resume from a committed "
            "checkpoint, whose cursor is at or after that point, or start a new run "
            "(another storage.run_uri); their commit records remain under stream/log/"
        )


def oldest_resume_cursor(checkpoints: CheckpointStore) -> Cursor | None:
    """The earliest stream cursor any committed checkpoint still stored resumes from; None
    when there is none. Under torch.distributed a collective, like the store's other reads:
    call it on every rank."""
    cursors = []
    for step in checkpoints.committed_steps():
        saved = checkpoints.read_state(step).stream_cursor
        cursors.append(Cursor.from_dict(saved) if saved else Cursor())  # no cursor: the start
    return min(cursors, default=None)


def release_consumed(run: Location, before: Cursor, fence: Fence | None = None) -> list[str]:
    """Delete the segments of the commit records wholly before `before` (seq < before.seq);
    return the names of those this call deleted.

    Idempotent, and never moves the released point back. The point is raised in
    `retention.json` *before* anything is deleted, so no reader starts in a segment being
    deleted; deletions go in log order, from where the last release finished; segments
    already gone are passed over, and so are rejected commit records (they name no segment:
    `storage.stream.records.CommitRecord`; counted in a warning). A storage error leaves the point
    raised and the deletion unfinished, which the next call completes. `fence.check()` (the
    learner's lease) is called right before each write: the point, each batch of deletions,
    the final record; when it raises, nothing more is written."""
    retention = read_retention(run)
    target = max(before.seq, retention.released_before_seq)
    if target == retention.deleted_before_seq:
        return []
    if target > retention.released_before_seq:
        _check(fence)
        _write_retention(run, StreamRetention(target, retention.deleted_before_seq))
    segments, stream = run.child("stream", "segments"), run.child("stream")
    deleted, rejected = [], []
    for start in range(retention.deleted_before_seq, target, _DELETE_BATCH):
        records = fetch_records(stream, start, min(_DELETE_BATCH, target - start))
        _check(fence)
        for record in records:
            if record.rejected:
                rejected.append(record.seq)
                continue
            try:
                segments.fs.rm(segments.join(record.segment), recursive=True)
            except FileNotFoundError:  # deleted by a release that stopped part-way
                continue
            deleted.append(record.segment)
    if rejected:
        log.warning(
            "stream retention of %s passed over %d rejected commit records (log numbers %s): "
            "they break the commit record's rules, so no path they name is deleted (readers "
            "quarantine them)", run.uri, len(rejected), rejected,
        )  # fmt: skip
    _check(fence)
    _write_retention(run, StreamRetention(target, target))
    return deleted


def _check(fence: Fence | None) -> None:
    if fence is not None:
        fence.check()
