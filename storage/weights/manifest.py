"""The records of the weight store: what a committed version holds and what one rank wrote.

A tensor is stored as *pieces*: ranges `[start, stop)` of its flattened (row-major) elements.
A learner rank's FSDP2 shard of a parameter is a range of dim-0 rows, so it is one piece; a
single process stores each tensor as one piece `[0, numel)`. A piece is encoded

- `full`: its elements, a 1-D tensor stored under the key `<name>@<start>`;
- `delta`: the elements that differ (bit for bit) from the same piece of the version `base`:
  their positions in the piece (`<name>@<start>.index`, int32, or int64 for pieces of 2^31
  elements or more) and their new values (`<name>@<start>.values`).

Every piece records the checksum of its *full* content in this version, so a piece rebuilt
from a base and a delta is verified exactly like one read whole. Checksums are xxh3-128 (hex):
integrity against corruption and truncation, not a defence against a malicious writer; sha256
kept 1.6 GB/s on the benchmark machine, xxh3 13 GB/s (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from datetime import datetime
from math import prod
from typing import Any, Literal

import torch
import xxhash

__all__ = [
    "CHECKSUM",
    "MANIFEST_FORMAT",
    "FileEntry",
    "PieceEntry",
    "SharePart",
    "TensorEntry",
    "WeightManifest",
    "checksum",
    "data_file_name",
    "index_dtype",
    "piece_key",
    "publish_of",
]

MANIFEST_FORMAT = "streamrl.weights.v2"
PART_FORMAT = "streamrl.weights.part.v1"
CHECKSUM = "xxh3_128"
_CHECKSUM_HEX = re.compile(r"[0-9a-f]{32}")


_FILE_SUFFIX = ".safetensors"
_DATA_FILE = re.compile(r"(?P<publish>.+)-r\d{5,}-\d{5,}" + re.escape(_FILE_SUFFIX))


def data_file_name(publish_id: str, rank: int, index: int) -> str:
    """The name of data file `index` (from 1) of rank `rank`'s share in publish `publish_id`."""
    return f"{publish_id}-r{rank:05d}-{index:05d}{_FILE_SUFFIX}"


def publish_of(file: str) -> str | None:
    """The publish id a data file was written by (None: not a data file's name)."""
    match = _DATA_FILE.fullmatch(file)
    return None if match is None else match["publish"]


def checksum(data: bytes | memoryview | torch.Tensor) -> str:
    """xxh3-128 of `data` (bytes, or a CPU tensor's raw bytes in memory order), as hex."""
    if isinstance(data, torch.Tensor):
        data = data.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return xxhash.xxh3_128_hexdigest(data)


def piece_key(name: str, start: int) -> str:
    """The safetensors key of a piece's elements (a delta adds `.index` and `.values`)."""
    return f"{name}@{start}"


def index_dtype(length: int) -> torch.dtype:
    """The dtype of a delta's positions in a piece of `length` elements."""
    return torch.int32 if length < 2**31 else torch.int64


def _check_int(value: object, minimum: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value!r}")


def _check_checksum(value: object, what: str) -> None:
    if not isinstance(value, str) or not _CHECKSUM_HEX.fullmatch(value):
        raise ValueError(f"{what}: checksum {value!r} is not 32 hex digits ({CHECKSUM})")


@dataclass(frozen=True)
class PieceEntry:
    """Elements `[start, stop)` of a flattened tensor, stored in `file` as `encoding`;
    `checksum` is that of the piece's full content in this version."""

    start: int
    stop: int
    file: str
    encoding: Literal["full", "delta"]
    checksum: str

    def __post_init__(self) -> None:
        _check_int(self.start, 0, "piece start")
        _check_int(self.stop, self.start + 1, "piece stop")
        if self.encoding not in ("full", "delta"):
            raise ValueError(f"piece encoding must be full or delta, got {self.encoding!r}")
        _check_checksum(self.checksum, f"piece {self.start}:{self.stop} in {self.file}")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor: dtype (torch name without `torch.`), shape, and pieces sorted by `start`.

    Invariant: pieces do not overlap and lie in `[0, numel)`. In a manifest they cover it
    exactly (`covers_all`); in one rank's `SharePart` they are that rank's pieces only.
    """

    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[PieceEntry, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        pieces = tuple(p if isinstance(p, PieceEntry) else PieceEntry(**p) for p in self.pieces)
        object.__setattr__(self, "pieces", pieces)
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        for dim in self.shape:
            _check_int(dim, 0, "each dimension")
        end = 0
        for piece in pieces:
            if piece.start < end:
                raise ValueError(f"pieces overlap or are out of order at element {piece.start}")
            end = piece.stop
        if end > self.numel:
            raise ValueError(f"a piece ends at element {end}, past the {self.numel} elements")

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor (what a full version stores of it)."""
        return self.numel * self.torch_dtype.itemsize

    def covers_all(self) -> bool:
        """The pieces tile `[0, numel)` with no gap."""
        covered = 0
        for piece in self.pieces:
            if piece.start != covered:
                return False
            covered = piece.stop
        return covered == self.numel

    def merged(self, other: TensorEntry) -> TensorEntry:
        """This tensor with the pieces of `other` (another rank's) added."""
        if (self.dtype, self.shape) != (other.dtype, other.shape):
            raise ValueError(
                f"ranks disagree on the tensor: {self.dtype}{list(self.shape)} vs "
                f"{other.dtype}{list(other.shape)}"
            )
        pieces = sorted((*self.pieces, *other.pieces), key=lambda p: p.start)
        return TensorEntry(self.dtype, self.shape, tuple(pieces))


@dataclass(frozen=True)
class FileEntry:
    """One uploaded safetensors file: name, byte size, checksum of its bytes."""

    file: str
    size: int
    checksum: str

    def __post_init__(self) -> None:
        if not isinstance(self.file, str) or "/" in self.file or not self.file:
            raise ValueError(f"file name {self.file!r} must be a plain name")
        _check_int(self.size, 1, f"size of {self.file}")
        _check_checksum(self.checksum, self.file)


def _files(raw: Any) -> tuple[FileEntry, ...]:
    return tuple(f if isinstance(f, FileEntry) else FileEntry(**f) for f in raw)


def _tensors(raw: dict[str, Any]) -> dict[str, TensorEntry]:
    return {
        name: entry if isinstance(entry, TensorEntry) else TensorEntry(**entry)
        for name, entry in raw.items()
    }


@dataclass(frozen=True)
class SharePart:
    """What one rank of a publish wrote: `<publish_id>-part-<rank>-of-<world>.json` in the
    version's folder, written after its files. `tensors` holds this rank's pieces only;
    `base` is the version its delta pieces apply to (None: none is a delta); `error` set means
    the rank's upload failed and the version must not be committed."""

    rank: int
    world: int
    files: tuple[FileEntry, ...] = ()
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    base: int | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        _check_int(self.world, 1, "world size")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is not in [0, {self.world})")
        object.__setattr__(self, "files", _files(self.files))
        object.__setattr__(self, "tensors", _tensors(self.tensors))

    def to_json(self) -> str:
        return json.dumps({"format": PART_FORMAT, **asdict(self)})

    @classmethod
    def from_json(cls, text: str | bytes) -> SharePart:
        raw = json.loads(text)
        try:
            if raw.pop("format") != PART_FORMAT:
                raise ValueError(f"format is not {PART_FORMAT!r}")
            return cls(**raw)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"malformed publish part: {exc!r}") from exc


@dataclass(frozen=True)
class WeightManifest:
    """What one committed version holds; the only thing readers trust.

    Invariants (checked on construction, so on every read):
    - `version` is an int > 0 and equals its folder (checked by the reader);
    - `base` is None for a full version (every piece `full`), else a smaller version: the one
      every `delta` piece applies to (the previous version);
    - every tensor's pieces tile it; every piece's file is listed in `files` exactly once;
    - `checksum` names the hash of files and pieces; `model_config` is the publisher's JSON
      object; `created_at` is ISO 8601 UTC;
    - `epoch` is the lease epoch its writer held when it wrote the manifest (an int >= 0), or
      None: written without a lease, or by a release before leases (then absent from the
      JSON, so those manifests still load and fenceless ones read as before).
    """

    version: int
    base: int | None
    tensors: dict[str, TensorEntry]
    files: tuple[FileEntry, ...]
    model_config: dict[str, Any]
    created_at: str
    checksum: str = CHECKSUM
    epoch: int | None = None

    def __post_init__(self) -> None:
        _check_int(self.version, 1, "weight version")
        if self.base is not None:
            _check_int(self.base, 1, "base version")
            if self.base >= self.version:
                raise ValueError(f"base {self.base} is not older than version {self.version}")
        if self.checksum != CHECKSUM:
            raise ValueError(f"checksum {self.checksum!r} is not {CHECKSUM!r}")
        if self.epoch is not None:
            _check_int(self.epoch, 0, "lease epoch")
        object.__setattr__(self, "tensors", _tensors(self.tensors))
        object.__setattr__(self, "files", _files(self.files))
        if not self.tensors:
            raise ValueError("a weight manifest needs at least one tensor")
        names = [f.file for f in self.files]
        if len(set(names)) != len(names):
            raise ValueError("a file is listed twice")
        used: set[str] = set()
        for name, entry in self.tensors.items():
            if not entry.covers_all():
                raise ValueError(f"the pieces of {name!r} do not cover it")
            for piece in entry.pieces:
                if piece.encoding == "delta" and self.base is None:
                    raise ValueError(f"{name!r} holds a delta piece in a full version")
                used.add(piece.file)
        if not used <= set(names):
            raise ValueError(f"pieces name files the manifest does not list: {used - set(names)}")
        if not isinstance(self.model_config, dict):
            raise ValueError("model_config must be a JSON object")
        datetime.fromisoformat(self.created_at)

    @property
    def is_full(self) -> bool:
        return self.base is None

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor in full (what a full version of these tensors stores)."""
        return sum(entry.nbytes for entry in self.tensors.values())

    @property
    def stored_bytes(self) -> int:
        """Bytes of this version's files."""
        return sum(f.size for f in self.files)

    def to_json(self) -> str:
        raw = asdict(self)
        if raw["epoch"] is None:
            del raw["epoch"]
        return json.dumps({"format": MANIFEST_FORMAT, **raw})

    @classmethod
    def from_json(cls, text: str | bytes) -> WeightManifest:
        """Parse and validate; any malformation raises `ValueError`."""
        raw = json.loads(text)
        try:
            found = raw.pop("format")
            if found != MANIFEST_FORMAT:
                raise ValueError(
                    f"format is {found!r}, not {MANIFEST_FORMAT!r} (written by another "
                    "streamrl release: publish a new version with this one)"
                )
            return cls(**raw)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"malformed weight manifest: {exc!r}") from exc
