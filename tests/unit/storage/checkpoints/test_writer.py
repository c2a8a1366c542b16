"""The hashing DCP writer (`storage.checkpoints.writer`), on both backends: what it records for
each file is the size and xxh3 of the bytes stored, however DCP writes them; a failed write is
not recorded; a listing that differs from what was written is refused."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash

from storage.checkpoints.ranks import single_process_is_intended
from storage.checkpoints.record import FileCheck
from storage.checkpoints.writer import HashingStream, HashingWriter, stored_as_written
from storage.fs import Location, StorageError


def _stored(folder: Location) -> dict[str, FileCheck]:
    """Every file in `folder`, with the size and xxh3 of its stored bytes, read independently."""
    out = {}
    for path in folder.fs.find(folder.path):
        data = folder.fs.cat_file(path)
        out[path.rsplit("/", 1)[-1]] = FileCheck(len(data), xxhash.xxh3_128_hexdigest(data))
    return out


def test_every_file_dcp_writes_is_recorded_as_stored(run_location: Location) -> None:
    folder = run_location.child("ckpt")
    generator = torch.Generator().manual_seed(0)
    state = {
        "big": torch.randn(300_000, generator=generator),  # more than fsspec's 5 MiB block
        "small": torch.arange(7, dtype=torch.int64),
        "halves": torch.randn(33, 5, generator=generator).to(torch.bfloat16),
        "extra": {"note": "pickled, not a tensor", "values": [1, 2.5]},
    }
    writer = HashingWriter(
        folder.uri, sync_files=folder.is_local, thread_count=2, **folder.storage_options()
    )
    with single_process_is_intended():
        dcp.save(state, storage_writer=writer)
    stored = _stored(folder)
    assert {".metadata", "__0_0.distcp", "__0_1.distcp"} == set(stored)  # two writer threads
    assert writer.written == stored


def test_a_failed_write_is_not_recorded(run_location: Location) -> None:
    folder = run_location.child("ckpt")
    writer = HashingWriter(folder.uri, sync_files=False, **folder.storage_options())
    writer.fs.mkdir(folder.path)

    def write_half() -> None:
        with writer.fs.create_stream(folder.join("__0_0.distcp"), "wb") as stream:
            stream.write(b"half a shard")
            raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        write_half()
    assert writer.written == {}  # on S3 the part may still land: a listing then refuses it


def test_a_buffer_reused_after_a_write_is_hashed_as_it_was_written(
    run_location: Location,
) -> None:
    folder = run_location.child("ckpt")
    writer = HashingWriter(folder.uri, sync_files=False, **folder.storage_options())
    writer.fs.mkdir(folder.path)
    buffer = bytearray(b"first piece|")
    with writer.fs.create_stream(folder.join("a.tmp"), "wb") as stream:
        stream.write(buffer)
        buffer[:] = b"overwritten!"  # what a writer that reuses its buffer does
        stream.write(memoryview(buffer)[:5])
    writer.fs.rename(folder.join("a.tmp"), folder.join("a"))
    assert folder.fs.cat_file(folder.join("a")) == b"first piece|overw"
    assert writer.written == _stored(folder)


class _ShortWriter(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:
        return len(data) // 2


def test_a_short_write_raises_instead_of_hashing_bytes_not_written() -> None:
    with pytest.raises(OSError, match="short write: 2 of 4 bytes"):
        HashingStream(_ShortWriter()).write(b"abcd")


def test_a_listing_that_differs_from_what_was_written_is_refused(run_location: Location) -> None:
    folder = run_location.child("ckpt")
    folder.fs.makedirs(folder.path, exist_ok=True)
    folder.fs.pipe_file(folder.join("a"), b"12345")
    folder.fs.pipe_file(folder.join("COMMITTED"), b"{}")  # never part of what is compared
    stored_as_written(folder, {"a": FileCheck.of(b"12345")})
    with pytest.raises(StorageError, match=r"a: 5 stored, 4 written"):
        stored_as_written(folder, {"a": FileCheck.of(b"1234")})
    folder.fs.pipe_file(folder.join("stray"), b"from a dead save")
    with pytest.raises(StorageError, match=r"stray: 16 stored, none written"):
        stored_as_written(folder, {"a": FileCheck.of(b"12345")})
