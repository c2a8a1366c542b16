"""A rank's share of a weight version as data files: its encoded pieces packed into safetensors
files of about `shard_bytes`, uploaded into the version's folder (the layout, and where this
step sits in a publish: `storage.weights.publish`).

Files are filled piece by piece, never entry by entry: a delta piece's `.index` and `.values`
must land in the one file its piece entry names. One batch of files uploads while the next is
serialised, so at most two batches (about `IO_BATCH_BYTES` each) are in memory.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import safetensors.torch

from storage.fs import Location
from storage.weights.manifest import (
    FileEntry,
    PieceEntry,
    TensorEntry,
    checksum,
    data_file_name,
    piece_key,
)
from storage.weights.pieces import EncodedShare
from storage.weights.versions import IO_BATCH_BYTES, batches

__all__ = ["upload_share"]


def upload_share(
    folder: Location, publish_id: str, rank: int, encoded: EncodedShare, shard_bytes: int
) -> tuple[tuple[FileEntry, ...], dict[str, TensorEntry]]:
    """Serialise `encoded` into files of about `shard_bytes` and upload them into `folder` (a
    version's); returns the files written and every tensor's entry with its pieces' files."""
    keys_of: dict[str, list[str]] = {}
    for key in encoded.entries:
        keys_of.setdefault(_piece_of_key(key), []).append(key)
    sizes = [
        (piece, sum(encoded.entries[k].nbytes for k in keys)) for piece, keys in keys_of.items()
    ]
    file_of: dict[str, str] = {}
    files: list[FileEntry] = []
    pending: dict[str, bytes] = {}
    with ThreadPoolExecutor(1, thread_name_prefix="weight-upload") as uploader:
        uploading: Future[None] | None = None
        for index, pieces in enumerate(batches(sizes, shard_bytes), start=1):
            file = data_file_name(publish_id, rank, index)
            keys = [key for piece in pieces for key in keys_of[piece]]
            data = safetensors.torch.save({key: encoded.entries[key] for key in keys})
            files.append(FileEntry(file, len(data), checksum(data)))
            file_of.update((key, file) for key in keys)
            pending[folder.join(file)] = data
            if sum(map(len, pending.values())) >= IO_BATCH_BYTES:
                if uploading is not None:
                    uploading.result()
                uploading = uploader.submit(folder.fs.pipe, pending)  # concurrent PUTs on S3
                pending = {}
        if uploading is not None:
            uploading.result()
        if pending:
            folder.fs.pipe(pending)
    tensors = {
        name: TensorEntry(
            entry.dtype,
            entry.shape,
            tuple(
                PieceEntry(p.start, p.stop, file_of[_first_key(name, p)], p.encoding, p.checksum)
                for p in entry.pieces
            ),
        )
        for name, entry in encoded.tensors.items()
    }
    return tuple(files), tensors


def _piece_of_key(key: str) -> str:
    """The piece key (`<name>@<start>`) a safetensors entry belongs to: a full piece's own key
    ends in its start's digits, a delta's two entries add `.index` / `.values` to it."""
    return key.removesuffix(".index").removesuffix(".values")


def _first_key(name: str, piece: PieceEntry) -> str:
    """The safetensors key that locates `piece` in the files written."""
    key = piece_key(name, piece.start)
    return key if piece.encoding == "full" else f"{key}.index"
