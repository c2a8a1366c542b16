"""The replay stream: generators append scored groups, the learner reads them in commit order.

Layout under `<run>/stream/`:

    segments/<writer>-<incarnation>-<n:06d>/   immutable Zarr v3 group (see `storage.segments`)
    log/<seq:012d>.json                        commit record naming one segment
    quarantine/<seq:012d>.json                 committed segments that failed to read

Writing a segment: upload all its objects (concurrently on S3), then claim the next log number
with a create-if-absent write of the commit record. On a conflict the writer reads the record
there — its own (a retried request that had landed) ends the claim, another writer's means
"jump forward" to the first free number. The log is therefore gap-free, and commit order is
the one order every reader sees. A writer killed before its commit leaves an orphan segment
that no reader ever opens; `sweep_orphans` deletes those after a grace period. Every writer
process draws a fresh incarnation id, so a restarted writer never touches a half-written
segment of its previous life.

Reading: a `Cursor` (log number, group offset) is the position; each round fetches the next
few commit records at once, keeps the contiguous run, fetches all their segments' objects at
once, and checks sizes and CRC32s before decoding. A committed segment that fails is
quarantined — recorded under `quarantine/`, logged and counted — and the reader goes on.
"""

from __future__ import annotations

import json
import logging
import queue
import re
import secrets
import threading
import time
import zlib
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TypeVar

from storage.fs import Location, put_if_absent
from storage.records import CommitRecord, Cursor, InvalidRecordError, ScoredGroup
from storage.segments import Compression, CorruptSegmentError, decode_segment, encode_segment

__all__ = [
    "StreamReader",
    "StreamTimeoutError",
    "StreamWriter",
    "UploadedSegment",
    "orphan_segments",
    "quarantined",
    "read_log",
    "sweep_orphans",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

_WRITER_ID = re.compile(r"[A-Za-z0-9_.]+")
_MAX_UNRESOLVED_CLAIMS = 20


class StreamTimeoutError(TimeoutError):
    """No new group arrived within the reader's timeout."""


def _log_path(stream: Location, seq: int) -> str:
    return stream.join("log", f"{seq:012d}.json")


@dataclass(frozen=True)
class UploadedSegment:
    """A segment whose objects are all stored but which no commit record names yet."""

    record: CommitRecord  # seq still unset (-1)


@dataclass
class WriterStats:
    segments: int = 0
    groups: int = 0
    bytes: int = 0
    commit_conflicts: int = 0


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
    ) -> None:
        if not _WRITER_ID.fullmatch(writer_id):
            raise ValueError(f"writer id {writer_id!r} may use only letters, digits, '_' and '.'")
        self.stream = run.child("stream")
        self.writer_id = writer_id
        self.incarnation = f"{int(time.time() * 1000):x}{secrets.token_hex(3)}"
        self.compression: Compression = compression
        self.level = level
        self.stats = WriterStats()
        self._segment_number = 0
        self._next_seq = 0
        self._pending: list[ScoredGroup] = []
        self._pending_since: float | None = None

    # -- buffered appends --------------------------------------------------------------------

    def append(self, group: ScoredGroup) -> None:
        """Buffer one group for the next segment (validated now, so errors name it)."""
        group.validate()
        if not self._pending:
            self._pending_since = time.monotonic()
        self._pending.append(group)

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
        name = f"{self.writer_id}-{self.incarnation}-{self._segment_number:06d}"
        self._segment_number += 1
        folder = self.stream.child("segments", name)
        _put_objects(folder, objects)
        versions = [g.policy_version for g in groups]
        record = CommitRecord(
            seq=-1,
            segment=name,
            writer_id=self.writer_id,
            incarnation=self.incarnation,
            num_groups=len(groups),
            num_responses=sum(g.group_size for g in groups),
            num_tokens=sum(g.num_tokens for g in groups),
            min_policy_version=min(versions),
            max_policy_version=max(versions),
            objects={k: (len(v), zlib.crc32(v)) for k, v in objects.items()},
        )
        self.stats.bytes += sum(len(v) for v in objects.values())
        return UploadedSegment(record)

    def commit(self, uploaded: UploadedSegment) -> CommitRecord:
        """Claim the next free log number for an uploaded segment; return the stored record."""
        fs = self.stream.fs
        seq = self._next_seq
        unresolved = 0
        while True:
            record = replace(uploaded.record, seq=seq, committed_at=time.time())
            if put_if_absent(fs, _log_path(self.stream, seq), record.to_json()):
                break
            existing = _read_record(self.stream, seq)
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
            seq = _first_free(self.stream, seq + 1)
        self._next_seq = seq + 1
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


def _read_record(stream: Location, seq: int) -> CommitRecord | None:
    try:
        data = stream.fs.cat_file(_log_path(stream, seq))
    except FileNotFoundError:
        return None
    return CommitRecord.from_json(data, seq)


def _first_free(stream: Location, start: int) -> int:
    """Smallest log number ≥ start with no record (the log is a gap-free prefix).

    Gallops forward then bisects: O(log n) existence checks however far behind `start` is.
    """
    exists = stream.fs.exists
    if not exists(_log_path(stream, start)):
        return start
    taken, step = start, 1
    while exists(_log_path(stream, start + step)):
        taken, step = start + step, step * 2
    free = start + step
    while free - taken > 1:
        mid = (taken + free) // 2
        if exists(_log_path(stream, mid)):
            taken = mid
        else:
            free = mid
    return free


def read_log(run: Location, start: int = 0, batch: int = 64) -> Iterator[CommitRecord]:
    """Commit records from `start` up to the current end of the log, in order."""
    stream = run.child("stream")
    seq = start
    while True:
        records = _fetch_records(stream, seq, batch)
        yield from records
        if len(records) < batch:
            return
        seq += batch


def _fetch_records(stream: Location, start: int, count: int) -> list[CommitRecord]:
    """The contiguous run of existing records in [start, start + count), in one round."""
    paths = [_log_path(stream, s) for s in range(start, start + count)]
    found = stream.fs.cat(paths, on_error="omit")
    records = []
    for seq, path in zip(range(start, start + count), paths, strict=True):
        if path not in found:
            break
        records.append(CommitRecord.from_json(found[path], seq))
    return records


@dataclass
class ReaderStats:
    records: int = 0
    groups: int = 0
    quarantined: list[int] = field(default_factory=list)
    transient_errors: int = 0


class StreamReader:
    """Reads the stream in commit order from a cursor.

    Consumes: commit records and their segments. Produces: `ScoredGroup`s, one at a time, with
    `cursor` pointing just past the last one returned (save it to resume exactly there).
    Waits for: the next commit record; polls with back-off up to `max_poll_s`.
    """

    def __init__(
        self,
        run: Location,
        cursor: Cursor | None = None,
        *,
        records_per_round: int = 16,
        max_poll_s: float = 1.0,
        prefetch_rounds: int = 2,
    ) -> None:
        self.stream = run.child("stream")
        self.cursor = cursor or Cursor()
        self.records_per_round = records_per_round
        self.max_poll_s = max_poll_s
        self.prefetch_rounds = prefetch_rounds
        self.stats = ReaderStats()

    def poll(self, start: Cursor | None = None) -> list[tuple[Cursor, ScoredGroup | None]]:
        """One round: the groups committed after `start` (default: the cursor), each paired
        with the cursor just past it.

        An entry with group None only moves the cursor past a quarantined segment. Does not
        move `self.cursor` (the caller decides what it has consumed)."""
        start = start or self.cursor
        records = _fetch_records(self.stream, start.seq, self.records_per_round)
        if not records:
            return []
        objects = self._fetch_objects(records)
        out: list[tuple[Cursor, ScoredGroup | None]] = []
        for record in records:
            try:
                groups = self._decode(record, objects)
            except CorruptSegmentError as exc:
                self._quarantine(record, exc)
                out.append((Cursor(record.seq + 1), None))
                continue
            first = start.offset if record.seq == start.seq else 0
            for i in range(first, len(groups)):
                after = Cursor(record.seq, i + 1) if i + 1 < len(groups) else Cursor(record.seq + 1)
                out.append((after, groups[i]))
            if first >= len(groups):  # a cursor at the very end of a segment
                out.append((Cursor(record.seq + 1), None))
        self.stats.records += len(records)
        return out

    def groups(self, timeout_s: float | None = None) -> Iterator[ScoredGroup]:
        """Yield groups forever, in commit order; `cursor` moves past each one as it is yielded.

        With `prefetch_rounds > 0` a background thread fetches and decodes up to that many
        rounds ahead, so storage latency hides behind the consumer's work.
        Raises `StreamTimeoutError` when no group arrives for `timeout_s` seconds.
        """
        stop = threading.Event()
        rounds = self._rounds(self.cursor, timeout_s, stop)
        if self.prefetch_rounds > 0:
            rounds = _prefetched(rounds, self.prefetch_rounds, stop)
        try:
            for items in rounds:
                for after, group in items:
                    self.cursor = after
                    if group is not None:
                        self.stats.groups += 1
                        yield group
        finally:
            stop.set()
            rounds.close()

    def _rounds(
        self, start: Cursor, timeout_s: float | None, stop: threading.Event
    ) -> Generator[list[tuple[Cursor, ScoredGroup | None]], None, None]:
        """Successive non-empty rounds from `start`, waiting with back-off in between, until
        `stop` is set."""
        position, wait, idle_since = start, 0.05, time.monotonic()
        while not stop.is_set():
            try:
                items = self.poll(position)
            except (OSError, TimeoutError) as exc:  # transient storage error: counted, retried
                self.stats.transient_errors += 1
                log.warning("stream read failed (%s); retrying", exc)
                items = []
            if items:
                yield items
                position, wait, idle_since = items[-1][0], 0.05, time.monotonic()
                continue
            if timeout_s is not None and time.monotonic() - idle_since > timeout_s:
                raise StreamTimeoutError(
                    f"no new group in {self.stream.uri} for {timeout_s:.0f}s "
                    f"(cursor {position.seq}:{position.offset})"
                )
            stop.wait(wait)
            wait = min(wait * 2, self.max_poll_s)

    def _fetch_objects(self, records: Sequence[CommitRecord]) -> dict[str, bytes | Exception]:
        paths = [self.stream.join("segments", r.segment, key) for r in records for key in r.objects]
        return self.stream.fs.cat(paths, on_error="return")

    def _decode(
        self, record: CommitRecord, fetched: dict[str, bytes | Exception]
    ) -> list[ScoredGroup]:
        objects: dict[str, bytes] = {}
        for key, (size, crc) in record.objects.items():
            data = fetched.get(self.stream.join("segments", record.segment, key))
            if not isinstance(data, bytes):
                raise CorruptSegmentError(f"object {key!r} is unreadable: {data!r}")
            if len(data) != size or zlib.crc32(data) != crc:
                raise CorruptSegmentError(f"object {key!r} fails its size/CRC32 check")
            objects[key] = data
        try:
            groups = decode_segment(objects)
        except InvalidRecordError as exc:
            raise CorruptSegmentError(str(exc)) from exc
        if len(groups) != record.num_groups:
            raise CorruptSegmentError(
                f"holds {len(groups)} groups, its commit record says {record.num_groups}"
            )
        return groups

    def _quarantine(self, record: CommitRecord, error: Exception) -> None:
        """Skip a committed segment that does not read, leaving a record of why."""
        self.stats.quarantined.append(record.seq)
        log.error(
            "quarantined stream segment %s (log %d) of %s: %s",
            record.segment, record.seq, record.writer_id, error,
        )  # fmt: skip
        note = {
            "seq": record.seq,
            "segment": record.segment,
            "at": time.time(),
            "error": str(error),
        }
        put_if_absent(
            self.stream.fs,
            self.stream.join("quarantine", f"{record.seq:012d}.json"),
            json.dumps(note).encode(),
        )


def _prefetched(
    source: Generator[T, None, None], depth: int, stop: threading.Event
) -> Generator[T, None, None]:
    """Run `source` in a background thread, at most `depth` items ahead of the consumer.

    Exceptions of the source reach the consumer. Closing the consumer sets `stop`, which the
    source (and the thread) must watch."""
    items: queue.Queue[tuple[str, object]] = queue.Queue(maxsize=depth)

    def produce() -> None:
        try:
            for item in source:
                while not stop.is_set():
                    try:
                        items.put(("item", item), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            items.put(("end", None))
        except BaseException as exc:  # handed to the consumer, which raises it
            items.put(("error", exc))
        finally:
            source.close()

    thread = threading.Thread(target=produce, name="stream-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            kind, value = items.get()
            if kind == "item":
                yield value  # type: ignore[misc]
            elif kind == "error":
                raise value  # type: ignore[misc]
            else:
                return
    finally:
        stop.set()
        thread.join(timeout=5)


def quarantined(run: Location) -> list[int]:
    """Log numbers of every committed segment a reader has quarantined."""
    folder = run.child("stream", "quarantine")
    if not folder.fs.exists(folder.path):
        return []
    return sorted(
        int(p.rsplit("/", 1)[-1].split(".")[0]) for p in folder.fs.ls(folder.path, detail=False)
    )


def _modified(info: dict) -> float:
    value = info.get("mtime", info.get("LastModified", info.get("created")))
    if isinstance(value, datetime):
        return value.timestamp()
    return float(value or 0.0)


def orphan_segments(run: Location, grace_s: float, *, now: float | None = None) -> list[str]:
    """Segment folders that no commit record names and whose newest object is older than
    `grace_s`: a writer commits within moments of its upload, so these belong to writers that
    died."""
    stream = run.child("stream")
    folder = stream.child("segments")
    if not folder.fs.exists(folder.path):
        return []
    committed = {r.segment for r in read_log(run)}
    now = time.time() if now is None else now
    orphans = []
    for path in folder.fs.ls(folder.path, detail=False):
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if name in committed:
            continue
        # Only objects count: some S3 servers list an emptied folder for a while after.
        infos = [i for i in folder.fs.find(path, detail=True).values() if i["type"] == "file"]
        if infos and now - max(_modified(i) for i in infos) >= grace_s:
            orphans.append(name)
    return orphans


def sweep_orphans(run: Location, grace_s: float, *, now: float | None = None) -> list[str]:
    """Delete the `orphan_segments`; returns the names removed."""
    folder = run.child("stream", "segments")
    removed = orphan_segments(run, grace_s, now=now)
    for name in removed:
        folder.fs.rm(folder.join(name), recursive=True)
    return removed
