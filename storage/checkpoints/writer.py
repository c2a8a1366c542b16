"""DCP's fsspec writer, hashing every file on the way out: a checkpoint's save reads nothing back.

`HashingWriter` is `FsspecWriter` whose streams count and xxh3-hash the bytes as DCP writes
them, so that COMMITTED (`storage.checkpoints.record`) is written from what was written rather
than from a download of every shard. Every stream DCP opens for writing (the shards, in each of
its writer threads, and the `.metadata` that its coordinator writes as `.metadata.tmp` and
renames) is wrapped in a `HashingStream`; after `dcp.save`, `gather_written` brings every
rank's `{name: FileCheck}` to every rank.

Invariants:
- A hash covers exactly the bytes the file received: each write is hashed from the buffer it
  was handed, at the moment the underlying stream copies it (fsspec's write buffer, or the
  OS), and a short write raises rather than leaving bytes hashed but unwritten. DCP writes
  every file front to back; a seek would raise (the stream is not seekable).
- A file counts only once its stream closed without error (for S3, once its upload finished);
  a file removed through the writer is forgotten, a renamed one keeps its check.
- What is recorded is checked against one listing of the folder before it is committed
  (`stored_as_written`): same names, same sizes. The content itself is checked by `load`.
"""

from __future__ import annotations

import io
import os
import posixpath
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import xxhash
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecWriter

from storage.checkpoints.ranks import all_gather
from storage.checkpoints.record import FileCheck, stored_sizes
from storage.fs import Location, StorageError

__all__ = ["HashingStream", "HashingWriter", "gather_written", "stored_as_written"]


class HashingStream(io.RawIOBase):
    """A write-only stream that passes every write on to `raw` and hashes what `raw` took."""

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self._raw = raw
        self._digest = xxhash.xxh3_128()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        written = self._raw.write(view)
        if written is not None and written != view.nbytes:
            raise OSError(f"short write: {written} of {view.nbytes} bytes")
        self._digest.update(view)
        self.size += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        if not self.closed and not self._raw.closed:  # raw is closed first when a write failed
            self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        if not self.closed:
            super().close()  # flushes
            self._raw.close()

    def check(self) -> FileCheck:
        """The size and xxh3 of everything written so far."""
        return FileCheck(self.size, self._digest.hexdigest())


class _HashingFileSystem(FileSystem):
    """DCP's fsspec file system, recording `written` (name → FileCheck) for every file it
    writes in full ("wb"); other modes pass through unrecorded."""

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[str, FileCheck] = {}
        self._lock = threading.Lock()  # DCP may write from several threads

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = HashingStream(raw)
            yield stream
            stream.close()  # an upload completes here; if it fails, the file is removed
        with self._lock:
            self.written[_name(path)] = stream.check()

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        with self._lock:
            if (check := self.written.pop(_name(path), None)) is not None:
                self.written[_name(new_path)] = check

    def rm_file(self, path: str | os.PathLike) -> None:
        super().rm_file(path)
        with self._lock:
            self.written.pop(_name(path), None)


class HashingWriter(FsspecWriter):
    """`FsspecWriter` into the folder `path` that records the size and xxh3 of every file it
    writes (`written`), as it writes it. `storage_options` go to fsspec; `sync_files` and
    `thread_count` (files per rank, one writer thread each) mean what they do for FsspecWriter.
    One writer per `dcp.save`: DCP's `reset` at the start of a save forgets earlier files."""

    def __init__(
        self, path: str, *, sync_files: bool, thread_count: int = 1, **storage_options: Any
    ) -> None:
        super().__init__(path, sync_files=sync_files, thread_count=thread_count, **storage_options)
        self.fs = _HashingFileSystem()
        self.path = self.fs.init_path(path, **storage_options)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        self.fs.written.clear()

    @property
    def written(self) -> dict[str, FileCheck]:
        """name → size and xxh3 of every file this rank wrote in full."""
        return dict(self.fs.written)


def gather_written(writer: HashingWriter) -> dict[str, FileCheck]:
    """Every rank's `writer.written`, merged (a collective: every rank gets them all)."""
    merged: dict[str, FileCheck] = {}
    for got in all_gather({"written": writer.written}):
        for name, check in got["written"].items():
            if name in merged:
                raise StorageError(f"{name} was written by two ranks in one checkpoint save")
            merged[name] = check
    return merged


def stored_as_written(folder: Location, written: dict[str, FileCheck]) -> None:
    """Raise `StorageError` unless the files in `folder` (one listing) are exactly the files
    `written` (COMMITTED aside), at the sizes written."""
    stored = stored_sizes(folder)
    differ = sorted(
        name
        for name in stored.keys() | written.keys()
        if name not in written or stored.get(name) != written[name].size
    )
    if differ:
        details = ", ".join(
            f"{name}: {stored.get(name, 'absent')} stored, "
            f"{written[name].size if name in written else 'none'} written"
            for name in differ
        )
        raise StorageError(
            f"checkpoint {folder.uri}: the stored files differ from those written ({details}); "
            "nothing was committed, save again"
        )


def _name(path: str | os.PathLike) -> str:
    return posixpath.basename(os.fspath(path))
