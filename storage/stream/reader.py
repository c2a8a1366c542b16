"""Reading the replay stream in commit order (see `storage.stream.writer` for the layout).

A `Cursor` (log number, group offset) is the position; each round fetches the next few commit
records at once, keeps the contiguous run, fetches all their segments' objects at once, and
checks sizes and CRC32s before decoding.

Records too old to train on are not downloaded: when the reader is given
`oldest_usable_version` (a callable, evaluated once per round as its records are fetched), a
record whose `max_policy_version` is below it is passed over unread — the consumer gets one
`SkippedSegment` with the number of groups it stands for and their rollout sums (from the
record), and the cursor moves past the segment exactly as if those groups had been read one by
one. Only whole segments with such sums are skipped (a cursor inside a segment, or a record
written before records carried sums, is read as usual). Deciding with a bound read earlier than the
consumer's own check (the prefetch thread reads ahead) is safe as long as the bound never
decreases: a group below an earlier bound is below every later one.

What a failed read means — only proof of corruption loses a committed segment:

* **Invalid record** — the commit record itself breaks its invariants (unreadable, or a
  segment or object name outside the writers' naming rule: `storage.stream.records.CommitRecord`):
  it is quarantined like a corrupt segment, and nothing it names is fetched.
* **Corrupt** — an object's size or CRC32 differs from its commit record, or it does not
  decode: the segment is quarantined (a note under `quarantine/`, logged, counted in
  `ReaderStats.quarantined`) and the reader goes on past it.
* **Missing** — an object the commit record names does not exist. S3 and local disks are
  read-after-write consistent and a writer stores every object before its commit, so only a
  deletion explains it; still, it is retried like a transient error for `missing_grace_s`
  (stores with slower propagation) and quarantined only if it is still missing after that.
* **Transient** — anything else (timeout, refused connection, S3 5xx, any OSError): the round
  is retried with exponential back-off up to `max_retry_wait_s`, without moving the cursor,
  counted in `ReaderStats.transient_errors` and logged as a warning. Retries go on for as long
  as the caller waits: `groups(timeout_s=...)` raises `StreamTimeoutError` (naming the last
  storage error) once no group arrived for `timeout_s`, however the time was spent; the cursor
  then still points at the first group not delivered, so resuming from it loses nothing.
"""

from __future__ import annotations

import json
import logging
import queue
import re
import threading
import time
import zlib
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from storage.fs import Location, put_if_absent
from storage.stream.log import StorageUnavailableError, cat_objects, fetch_records, storage_io
from storage.stream.records import (
    CommitRecord,
    Cursor,
    InvalidRecordError,
    RolloutSums,
    ScoredGroup,
)
from storage.stream.retention import check_not_released
from storage.stream.segments import CorruptSegmentError, decode_segment

__all__ = ["ReaderStats", "SkippedSegment", "StreamReader", "StreamTimeoutError", "quarantined"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_FIRST_WAIT_S = 0.05
_NOTE = re.compile(r"(\d{12})\.json")  # quarantine/<seq:012d>.json


class StreamTimeoutError(TimeoutError):
    """No new group arrived within the reader's timeout."""


@dataclass
class ReaderStats:
    """What a reader has done so far (the learner logs these)."""

    records: int = 0  # commit records read
    groups: int = 0  # groups handed to the consumer
    quarantined: list[int] = field(default_factory=list)  # log numbers skipped as corrupt
    transient_errors: int = 0  # failed storage reads that were retried

    @property
    def num_quarantined(self) -> int:
        return len(self.quarantined)


@dataclass(frozen=True)
class SkippedSegment:
    """Committed segment `seq`, not downloaded because every one of its `num_groups` groups is
    too old: each has policy_version ≤ `max_policy_version`, which was below the reader's
    `oldest_usable_version` when the record was read. `rollout` sums its responses (from the
    commit record)."""

    seq: int
    num_groups: int
    max_policy_version: int
    rollout: RolloutSums


Round = list[tuple[Cursor, ScoredGroup | SkippedSegment | None]]


class StreamReader:
    """Reads the stream in commit order from a cursor.

    Consumes: commit records and their segments. Produces: `ScoredGroup`s, one at a time, with
    `cursor` pointing just past the last one returned (save it to resume exactly there), and,
    with `oldest_usable_version` set, a `SkippedSegment` in place of the groups of a segment
    whose commit record says they are all older than that version (see the module docstring).
    Waits for: the next commit record, or a store that failed to answer; polls with back-off
    up to `max_poll_s` (idle) or `max_retry_wait_s` (storage errors). `on_idle(cursor)`, with
    the consumer's cursor, is called whenever a poll found nothing new (from the prefetch thread
    when there is one). `write_notes=False` (a viewer: `streamrl samples`) skips a segment
    that does not read without writing its quarantine note.
    """

    def __init__(
        self,
        run: Location,
        cursor: Cursor | None = None,
        *,
        records_per_round: int = 16,
        max_poll_s: float = 1.0,
        prefetch_rounds: int = 2,
        max_retry_wait_s: float = 10.0,
        missing_grace_s: float = 30.0,
        oldest_usable_version: Callable[[], int] | None = None,
        on_idle: Callable[[Cursor], None] | None = None,
        write_notes: bool = True,
    ) -> None:
        self.run, self.stream = run, run.child("stream")
        self.write_notes = write_notes  # False: a viewer's reader skips, writes nothing
        # Must never decrease: the prefetch thread decides with the value of its round.
        self.oldest_usable_version = oldest_usable_version
        self.on_idle = on_idle
        self.cursor = cursor or Cursor()
        self.records_per_round = records_per_round
        self.max_poll_s = max_poll_s
        self.prefetch_rounds = prefetch_rounds
        self.max_retry_wait_s = max_retry_wait_s
        self.missing_grace_s = missing_grace_s
        self.stats = ReaderStats()
        self._missing_since: dict[int, float] = {}  # log number -> first seen missing

    def poll(self, start: Cursor | None = None) -> Round:
        """One round: the groups committed after `start` (default: the cursor), each paired
        with the cursor just past it.

        An entry with group None only moves the cursor past a quarantined segment (or the end
        of one); a `SkippedSegment` moves it past a segment too old to read. Does not move
        `self.cursor` (the caller decides what it has consumed). A transient storage error
        ends the round early (the segments before it are returned) or, when nothing could be
        read, raises `StorageUnavailableError`."""
        start = start or self.cursor
        records = fetch_records(self.stream, start.seq, self.records_per_round)
        if not records:
            return []
        oldest = None if self.oldest_usable_version is None else self.oldest_usable_version()
        unread = {
            r.seq
            for r in records
            if oldest is not None
            and r.max_policy_version < oldest
            and r.rollout is not None  # older records lack the sums: read those
            and not (r.seq == start.seq and start.offset)  # whole segments only
        }
        wanted = [r for r in records if r.seq not in unread and not r.rejected]
        fetched = cat_objects(self.stream.fs, self._object_paths(wanted))
        out: Round = []
        for record in records:
            first = start.offset if record.seq == start.seq else 0
            if record.rejected:  # names no path: nothing to fetch, nothing to decode
                self._quarantine(record, InvalidRecordError(record.rejected))
                out.append((Cursor(record.seq + 1), None))
                self.stats.records += 1
                continue
            if record.seq in unread:
                self.stats.records += 1
                skipped = SkippedSegment(
                    record.seq, record.num_groups, record.max_policy_version, record.rollout
                )
                out.append((Cursor(record.seq + 1), skipped))
                continue
            try:
                groups = self._read_segment(record, fetched)
            except CorruptSegmentError as exc:
                self._quarantine(record, exc)
                out.append((Cursor(record.seq + 1), None))
                self.stats.records += 1
                continue
            except StorageUnavailableError as exc:
                if not out:
                    raise
                self._count_transient(exc)  # deliver what was read; retry the rest next round
                break
            self.stats.records += 1
            for i in range(first, len(groups)):
                after = Cursor(record.seq, i + 1) if i + 1 < len(groups) else Cursor(record.seq + 1)
                out.append((after, groups[i]))
            if first >= len(groups):  # a cursor at the very end of a segment
                out.append((Cursor(record.seq + 1), None))
        return out

    def groups(self, timeout_s: float | None = None) -> Iterator[ScoredGroup | SkippedSegment]:
        """Yield groups forever, in commit order; `cursor` moves past each one as it is yielded.
        (A `SkippedSegment` comes only with `oldest_usable_version` set; the cursor is then past
        its segment.)

        With `prefetch_rounds > 0` a background thread fetches and decodes up to that many
        rounds ahead, so storage latency hides behind the consumer's work.
        Raises `StreamTimeoutError` when no group arrives for `timeout_s` seconds, and
        `ReleasedStreamError` at once if the cursor is before segments deleted as consumed
        (`storage.stream_retention`).
        """
        check_not_released(self.run, self.cursor)
        stop = threading.Event()
        rounds = self._rounds(self.cursor, timeout_s, stop)
        if self.prefetch_rounds > 0:
            rounds = _prefetched(rounds, self.prefetch_rounds, stop)
        try:
            for items in rounds:
                for after, item in items:
                    self.cursor = after
                    if item is None:
                        continue
                    if isinstance(item, ScoredGroup):
                        self.stats.groups += 1
                    yield item
        finally:
            stop.set()
            rounds.close()

    def _rounds(
        self, start: Cursor, timeout_s: float | None, stop: threading.Event
    ) -> Generator[Round, None, None]:
        """Successive non-empty rounds from `start`, waiting with back-off in between (longer
        after a storage error), until `stop` is set."""
        position, wait, idle_since = start, _FIRST_WAIT_S, time.monotonic()
        last_error: StorageUnavailableError | None = None
        while not stop.is_set():
            try:
                items, longest_wait = self.poll(position), self.max_poll_s
            except StorageUnavailableError as exc:  # retried from the same position
                self._count_transient(exc)
                items, longest_wait, last_error = [], self.max_retry_wait_s, exc
            if items:
                yield items
                position, wait, idle_since = items[-1][0], _FIRST_WAIT_S, time.monotonic()
                last_error = None
                continue
            if timeout_s is not None and time.monotonic() - idle_since > timeout_s:
                failing = f"; the last storage read failed: {last_error}" if last_error else ""
                raise StreamTimeoutError(
                    f"no new group in {self.stream.uri} for {timeout_s:.0f}s "
                    f"(cursor {position.seq}:{position.offset}){failing}"
                ) from last_error
            if self.on_idle is not None and last_error is None:
                self.on_idle(self.cursor)
            stop.wait(wait)
            wait = min(wait * 2, longest_wait)

    def verify(self, records: Sequence[CommitRecord]) -> dict[int, CorruptSegmentError]:
        """Read the segments of committed `records` and check them as `poll` does (a rejected
        record, sizes, CRC32s, decoding, group counts), without quarantining anything or moving
        the cursor: each that fails, by log number. An object missing counts as corrupt only
        after `missing_grace_s` (an audit passes 0); until then, and on any read that may still
        succeed, raises `StorageUnavailableError`."""
        fetched = cat_objects(
            self.stream.fs, self._object_paths([r for r in records if not r.rejected])
        )
        failed: dict[int, CorruptSegmentError] = {}
        for record in records:
            try:
                if record.rejected:
                    raise CorruptSegmentError(f"its commit record is rejected: {record.rejected}")
                self._read_segment(record, fetched)
            except CorruptSegmentError as exc:
                failed[record.seq] = exc
        return failed

    def _object_paths(self, records: Sequence[CommitRecord]) -> list[str]:
        return [self.stream.join("segments", r.segment, key) for r in records for key in r.objects]

    def _read_segment(
        self, record: CommitRecord, fetched: dict[str, bytes | Exception]
    ) -> list[ScoredGroup]:
        """The groups of a committed segment from its fetched objects.

        Raises `CorruptSegmentError` on proof of corruption (see the module docstring) and
        `StorageUnavailableError` when it may still read."""
        objects: dict[str, bytes] = {}
        for key, (size, crc) in record.objects.items():
            data = fetched.get(self.stream.join("segments", record.segment, key))
            if isinstance(data, FileNotFoundError):
                self._check_missing(record, key)
                raise StorageUnavailableError(
                    f"object {key!r} of segment {record.segment} is missing; retried for up "
                    f"to {self.missing_grace_s:g}s before the segment is quarantined"
                )
            if not isinstance(data, bytes):
                raise StorageUnavailableError(
                    f"reading object {key!r} of segment {record.segment}: {data!r}"
                ) from (data if isinstance(data, Exception) else None)
            if len(data) != size or zlib.crc32(data) != crc:
                raise CorruptSegmentError(f"object {key!r} fails its size/CRC32 check")
            objects[key] = data
        self._missing_since.pop(record.seq, None)
        try:
            groups = decode_segment(objects)
        except InvalidRecordError as exc:
            raise CorruptSegmentError(str(exc)) from exc
        if len(groups) != record.num_groups:
            raise CorruptSegmentError(
                f"holds {len(groups)} groups, its commit record says {record.num_groups}"
            )
        return groups

    def _check_missing(self, record: CommitRecord, key: str) -> None:
        """Raise `CorruptSegmentError` once an object of `record` has been missing for
        `missing_grace_s` (counted from the first read that missed it)."""
        now = time.monotonic()
        missing_for = now - self._missing_since.setdefault(record.seq, now)
        if missing_for >= self.missing_grace_s:
            raise CorruptSegmentError(
                f"object {key!r} has been missing for {missing_for:.0f}s although the commit "
                "record names it (deleted from the store?)"
            )

    def _count_transient(self, error: StorageUnavailableError) -> None:
        self.stats.transient_errors += 1
        log.warning("stream read of %s failed, retrying: %s", self.stream.uri, error)

    def _quarantine(self, record: CommitRecord, error: Exception) -> None:
        """Skip a committed segment that does not read, leaving a record of why."""
        note = {
            "seq": record.seq,
            "segment": record.segment,
            "at": time.time(),
            "error": str(error),
        }
        if self.write_notes:
            with storage_io(f"writing the quarantine note of log {record.seq}"):
                put_if_absent(
                    self.stream.fs,
                    self.stream.join("quarantine", f"{record.seq:012d}.json"),
                    json.dumps(note).encode(),
                )
        self._missing_since.pop(record.seq, None)
        self.stats.quarantined.append(record.seq)
        if record.rejected:
            log.error(
                "quarantined commit record %d of %s, which no reader reads and retention never "
                "deletes: %s", record.seq, self.stream.uri, error,
            )  # fmt: skip
            return
        log.error(
            "quarantined stream segment %s (log %d) of %s: %s",
            record.segment, record.seq, record.writer_id, error,
        )  # fmt: skip


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
    """Log numbers of every committed segment (or rejected record) a reader has quarantined;
    objects under `quarantine/` not named like a note are not counted."""
    folder = run.child("stream", "quarantine")
    if not folder.fs.exists(folder.path):
        return []
    names = (p.rsplit("/", 1)[-1] for p in folder.fs.ls(folder.path, detail=False))
    return sorted(int(m.group(1)) for n in names if (m := _NOTE.fullmatch(n)))
