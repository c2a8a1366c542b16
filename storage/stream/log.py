"""The replay stream's commit log, `<run>/stream/log/<seq:012d>.json`: one `CommitRecord` per
committed segment, gap-free from 0, in the one order every reader sees (see
`storage.stream.writer`).

Reading it tells "no record yet" (the object does not exist: the end of the log) apart from
"could not read" (anything else: a timeout, a refused connection, an S3 5xx). The second raises
`StorageUnavailableError`, never a shorter log: a reader that took a failed read for the end of
the log would wait instead of retrying, and a sweeper would take committed segments for orphans.

A stored record that breaks the commit record's invariants (unreadable, another log number, a
segment or object name outside the writers' naming rule) is returned as a rejected record
(`CommitRecord.rejected_record`) in its place: the log keeps one entry per log number, and no
path the stored record named reaches anyone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from fsspec import AbstractFileSystem

from storage.fs import Location
from storage.stream.records import CommitRecord, InvalidRecordError

__all__ = [
    "StorageUnavailableError",
    "cat_objects",
    "fetch_records",
    "first_free",
    "log_path",
    "parse_record",
    "read_log",
    "read_record",
    "storage_io",
]


class StorageUnavailableError(OSError):
    """A storage read or write failed for a reason that may pass (network, timeout, S3 5xx):
    retry it later; it says nothing about the data."""


@contextlib.contextmanager
def storage_io(what: str) -> Iterator[None]:
    """Raise any failure of the storage calls inside as `StorageUnavailableError` naming `what`.

    Wrap only filesystem calls: whatever they raise (OSError, botocore and aiohttp errors, 5xx)
    is about reaching the store, not about the data."""
    try:
        yield
    except StorageUnavailableError:
        raise
    except Exception as exc:
        raise StorageUnavailableError(f"{what}: {exc!r}") from exc


def cat_objects(fs: AbstractFileSystem, paths: Sequence[str]) -> dict[str, bytes | Exception]:
    """Fetch `paths` in one round (concurrently on S3); each value is the bytes or the error."""
    if not paths:
        return {}
    with storage_io(f"reading {len(paths)} objects"):
        return fs.cat(list(paths), on_error="return")


def log_path(stream: Location, seq: int) -> str:
    return stream.join("log", f"{seq:012d}.json")


def parse_record(data: bytes, seq: int) -> CommitRecord:
    """The stored commit record `seq`, or the rejected record standing for it when it breaks
    an invariant (`CommitRecord.rejected`: why)."""
    try:
        return CommitRecord.from_json(data, seq)
    except InvalidRecordError as exc:
        return CommitRecord.rejected_record(seq, str(exc))


def read_record(stream: Location, seq: int) -> CommitRecord | None:
    """The commit record `seq` (rejected if invalid), or None if there is none (yet)."""
    try:
        data = stream.fs.cat_file(log_path(stream, seq))
    except FileNotFoundError:
        return None
    return parse_record(data, seq)


def first_free(stream: Location, start: int) -> int:
    """Smallest log number ≥ start with no record (the log is a gap-free prefix).

    Gallops forward then bisects: O(log n) existence checks however far behind `start` is.
    """
    exists = stream.fs.exists
    if not exists(log_path(stream, start)):
        return start
    taken, step = start, 1
    while exists(log_path(stream, start + step)):
        taken, step = start + step, step * 2
    free = start + step
    while free - taken > 1:
        mid = (taken + free) // 2
        if exists(log_path(stream, mid)):
            taken = mid
        else:
            free = mid
    return free


def fetch_records(stream: Location, start: int, count: int) -> list[CommitRecord]:
    """The contiguous run of existing records in [start, start + count), in one round.

    Raises `StorageUnavailableError` if a record before the first missing one failed to read."""
    seqs = range(start, start + count)
    paths = [log_path(stream, s) for s in seqs]
    found = cat_objects(stream.fs, paths)
    records = []
    for seq, path in zip(seqs, paths, strict=True):
        data = found.get(path, FileNotFoundError(path))
        if isinstance(data, FileNotFoundError):
            break
        if isinstance(data, Exception):
            raise StorageUnavailableError(f"reading commit record {seq}: {data!r}") from data
        records.append(parse_record(data, seq))
    return records


def read_log(run: Location, start: int = 0, batch: int = 64) -> Iterator[CommitRecord]:
    """Commit records from `start` up to the current end of the log, in order.

    Raises `StorageUnavailableError` rather than stopping early when a record fails to read."""
    stream = run.child("stream")
    seq = start
    while True:
        records = fetch_records(stream, seq, batch)
        yield from records
        if len(records) < batch:
            return
        seq += batch
