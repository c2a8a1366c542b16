"""The replay stream: generators append scored groups, the learner reads them in commit order.

Layout under `<run>/stream/`:

    segments/<writer>-<incarnation>-<n:06d>/   immutable Zarr v3 group (`storage.stream.segments`)
    log/<seq:012d>.json                        commit record naming one segment
    quarantine/<seq:012d>.json                 committed segments that failed to read, and
                                               records that break the naming rule

Writing a segment (`StreamWriter`, here): upload all its objects (concurrently on S3), then
claim the next log number with a create-if-absent write of the commit record. On a conflict the
writer reads the record there — its own (a retried request that had landed) ends the claim,
another writer's means "jump forward" to the first free number. The log is therefore gap-free,
and commit order is the one order every reader sees. Every writer process draws a fresh
incarnation id, so a restarted writer never touches a half-written segment of its previous life.

Commit deadline: a writer commits a segment only within `commit_deadline_s` of the start of its
upload; past it, the same bytes are uploaded again under a fresh segment name and that one is
committed. This is what lets the sweeper remove old uncommitted segments safely.

A writer killed before its commit leaves an orphan segment that no reader ever opens;
`sweep_orphans` deletes those once they are older than a grace of at least the commit deadline
plus a margin (`storage.stream.sweep`, which proves the rule).

Reading (`StreamReader`, `storage.stream.reader`) follows the log from a cursor. Only proof
(size, CRC32, decoding, an object missing for long) quarantines a committed segment; a
transient storage error is retried without moving the cursor, so it never loses data.
The log itself: `storage.stream.log`. Every path a commit record names (its segment, its
objects) must follow the writers' naming rule (`storage.stream.records.CommitRecord`); a record that
does not is quarantined by readers and never read or deleted by anyone.
"""

from __future__ import annotations

import logging
import secrets
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from storage.fs import Location, put_if_absent
from storage.stream.log import StorageUnavailableError, first_free, log_path, read_log, read_record
from storage.stream.reader import (
    ReaderStats,
    SkippedSegment,
    StreamReader,
    StreamTimeoutError,
    quarantined,
)
from storage.stream.records import (
    GENERATOR_COUNTS,
    WRITER_ID,
    CommitRecord,
    RolloutSums,
    ScoredGroup,
    segment_name,
)
from storage.stream.segments import Compression, encode_segment
from storage.stream.sweep import (
    COMMIT_DEADLINE_S,
    SweepGraceError,
    min_sweep_grace_s,
    orphan_segments,
    sweep_orphans,
)

__all__ = [
    "COMMIT_DEADLINE_S",
    "ReaderStats",
    "SkippedSegment",
    "StorageUnavailableError",
    "StreamReader",
    "StreamTimeoutError",
    "StreamWriter",
    "SweepGraceError",
    "UploadedSegment",
    "min_sweep_grace_s",
    "orphan_segments",
    "quarantined",
    "read_log",
    "sweep_orphans",
]

log = logging.getLogger(__name__)

_MAX_UNRESOLVED_CLAIMS = 20
_MAX_REUPLOADS = 3  # of one segment past its commit deadline, before the writer gives up


@dataclass(frozen=True)
class UploadedSegment:
    """A segment whose objects are all stored but which no commit record names yet.

    Keeps its bytes until committed, to upload them again under a fresh name should the
    commit deadline pass first."""

    record: CommitRecord  # seq still unset (-1)
    objects: dict[str, bytes] = field(repr=False)
    upload_started: float  # time.monotonic() when its upload began


@dataclass
class WriterStats:
    segments: int = 0
    groups: int = 0
    bytes: int = 0
    commit_conflicts: int = 0
    reuploads: int = 0  # segments uploaded again because their commit deadline had passed


class StreamWriter:
    """Appends `ScoredGroup`s to the stream as segments.

    Consumes: groups from one generator (`append`, or whole segments via `write`).
    Produces: one segment and one commit record per `flush`.
    Waits for: storage only — never for a reader.
    """

    def __init__(
        self,
        run: Location,
        writer_id: str,
        *,
        compression: Compression = "blosc",
        level: int = 3,
        commit_deadline_s: float = COMMIT_DEADLINE_S,
    ) -> None:
        """`commit_deadline_s`: commit a segment only this soon after its upload began (a
        sweeper must use the same value: `sweep_orphans(commit_deadline_s=...)`)."""
        if commit_deadline_s <= 0:
            raise ValueError(f"commit_deadline_s must be > 0, got {commit_deadline_s}")
        if not WRITER_ID.fullmatch(writer_id):
            raise ValueError(f"writer id {writer_id!r} may use only letters, digits, '_' and '.'")
        self.stream = run.child("stream")
        self.writer_id = writer_id
        self.incarnation = f"{int(time.time() * 1000):x}{secrets.token_hex(3)}"
        self.compression: Compression = compression
        self.level = level
        self.commit_deadline_s = commit_deadline_s
        self.stats = WriterStats()
        self._segment_number = 0
        self._next_seq = 0
        self._pending: list[ScoredGroup] = []
        self._pending_since: float | None = None
        self._counts = dict.fromkeys(GENERATOR_COUNTS, 0)

    # -- buffered appends --------------------------------------------------------------------

    def append(self, group: ScoredGroup) -> None:
        """Buffer one group for the next segment (validated now, so errors name it)."""
        group.validate()
        if not self._pending:
            self._pending_since = time.monotonic()
        self._pending.append(group)

    def count_reward_failures(
        self, *, errors: int = 0, timeouts: int = 0, dropped_groups: int = 0
    ) -> None:
        """Add reward failures to those the next commit record carries (`CommitRecord`)."""
        self._counts["reward_errors"] += errors
        self._counts["reward_timeouts"] += timeouts
        self._counts["reward_dropped_groups"] += dropped_groups

    def count_judge_verdicts(self, verdicts: int, unparsed: int) -> None:
        """Add judge verdicts read, and those unparsed, to the next commit record's."""
        self._counts["judge_verdicts"] += verdicts
        self._counts["judge_unparsed"] += unparsed

    @property
    def pending_groups(self) -> int:
        return len(self._pending)

    @property
    def pending_age_s(self) -> float:
        """Seconds since the oldest buffered group arrived (0 when none)."""
        return 0.0 if self._pending_since is None else time.monotonic() - self._pending_since

    def flush(self) -> CommitRecord | None:
        """Write and commit the buffered groups as one segment; None if nothing is buffered."""
        if not self._pending:
            return None
        record = self.write(self._pending)
        self._pending, self._pending_since = [], None
        return record

    # -- segments ----------------------------------------------------------------------------

    def write(self, groups: Sequence[ScoredGroup]) -> CommitRecord:
        """Upload `groups` as one segment and commit it."""
        return self.commit(self.upload(groups))

    def upload(self, groups: Sequence[ScoredGroup]) -> UploadedSegment:
        """Store a segment's objects (all or nothing visible: it is not committed yet)."""
        objects = encode_segment(groups, self.compression, self.level)
        versions = [g.policy_version for g in groups]
        record = CommitRecord(
            seq=-1,
            segment="",
            writer_id=self.writer_id,
            incarnation=self.incarnation,
            num_groups=len(groups),
            num_responses=sum(g.group_size for g in groups),
            num_tokens=sum(g.num_tokens for g in groups),
            min_policy_version=min(versions),
            max_policy_version=max(versions),
            rollout=RolloutSums.of(groups),
            objects={k: (len(v), zlib.crc32(v)) for k, v in objects.items()},
        )
        self.stats.bytes += sum(len(v) for v in objects.values())
        return self._store(record, objects)

    def _store(self, record: CommitRecord, objects: dict[str, bytes]) -> UploadedSegment:
        """Upload `objects` as a segment of a fresh name, timed for the commit deadline."""
        name = segment_name(self.writer_id, self.incarnation, self._segment_number)
        self._segment_number += 1
        started = time.monotonic()
        _put_objects(self.stream.child("segments", name), objects)
        return UploadedSegment(replace(record, segment=name), objects, started)

    def _within_deadline(self, uploaded: UploadedSegment) -> UploadedSegment:
        """`uploaded`, or past its commit deadline (a sweeper may remove it from now on) the
        same bytes uploaded again under a fresh name."""
        reuploads = 0
        while (age := time.monotonic() - uploaded.upload_started) >= self.commit_deadline_s:
            if reuploads == _MAX_REUPLOADS:
                raise RuntimeError(
                    f"segment {uploaded.record.segment} of {self.stream.uri} was uploaded "
                    f"{_MAX_REUPLOADS + 1} times and never committed within the "
                    f"{self.commit_deadline_s:g}s commit deadline: the store is too slow for "
                    "it; raise commit_deadline_s (and the sweeper's grace with it) or check "
                    "the store"
                )
            fresh = self._store(uploaded.record, uploaded.objects)
            reuploads += 1
            self.stats.reuploads += 1
            log.warning(
                "segment %s of %s is %.1fs past its upload, beyond the %gs commit deadline; "
                "committing it as %s instead",
                uploaded.record.segment, self.stream.uri, age, self.commit_deadline_s,
                fresh.record.segment,
            )  # fmt: skip
            uploaded = fresh
        return uploaded

    def commit(self, uploaded: UploadedSegment) -> CommitRecord:
        """Claim the next free log number for an uploaded segment; return the stored record.

        Each claim is made within the commit deadline; past it, the segment is first uploaded
        again under a fresh name (the stored record names that one)."""
        fs = self.stream.fs
        seq = self._next_seq
        unresolved = 0
        while True:
            uploaded = self._within_deadline(uploaded)
            record = replace(uploaded.record, seq=seq, committed_at=time.time(), **self._counts)
            if put_if_absent(fs, log_path(self.stream, seq), record.to_json()):
                break
            existing = read_record(self.stream, seq)
            if existing is None:  # a concurrent conditional write lost without a winner: retry
                unresolved += 1
                if unresolved > _MAX_UNRESOLVED_CLAIMS:
                    raise RuntimeError(
                        f"log number {seq} of {self.stream.uri} was refused {unresolved} times "
                        "with no record appearing; is the store honouring If-None-Match?"
                    )
                time.sleep(min(0.01 * 2**unresolved, 1.0))
                continue
            if existing.same_commit(record):  # our own retried request had landed
                record = existing
                break
            self.stats.commit_conflicts += 1
            seq = first_free(self.stream, seq + 1)
        self._next_seq = seq + 1
        for key in GENERATOR_COUNTS:  # counted from the next commit on
            self._counts[key] -= getattr(record, key)
        self.stats.segments += 1
        self.stats.groups += record.num_groups
        return record


def _put_objects(folder: Location, objects: dict[str, bytes]) -> None:
    fs = folder.fs
    paths = {folder.join(key): data for key, data in objects.items()}
    if folder.is_local:
        for parent in sorted({p.rsplit("/", 1)[0] for p in paths}):
            fs.makedirs(parent, exist_ok=True)
    fs.pipe(paths)  # concurrent puts on async filesystems (s3fs)
