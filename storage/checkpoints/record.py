"""A checkpoint's COMMITTED record: which files the checkpoint is, with each one's size and
xxh3, and how they are checked (`storage.checkpoints.dcp` writes and trusts it).

    {"format": 2, "step": n, "world_size": w, "checksum": "xxh3_128", "epoch": e,
     "files": {"__0_0.distcp": {"size": bytes, "xxh3": hex}, ".metadata": {...},
               "learner_state.json": {...}}}

`epoch` is the writer's lease epoch (`storage.control.fencing.Fence`), absent when it had none.
Format 1 (before checksums) listed `{name: size}` and the learner state's sha256: such a
checkpoint is checked by sizes only, and still loads.

Checksums are xxh3-128, as the weight store's (`storage.weights.manifest.CHECKSUM`): integrity
against corruption and truncation, not a defence against whoever can write the run's storage
(DCP's `.metadata` is a pickle: such a writer can run code in the learner anyway).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from dataclasses import dataclass, field
from typing import Any

import xxhash
from fsspec import AbstractFileSystem

from storage.fs import Location, StorageError
from storage.weights.manifest import CHECKSUM, checksum

__all__ = [
    "COMMITTED",
    "LEARNER_STATE",
    "CommittedRecord",
    "FileCheck",
    "file_checksum",
    "stored_sizes",
]

COMMITTED = "COMMITTED"
LEARNER_STATE = "learner_state.json"
FORMAT = 2
_FILE_NAME = re.compile(r"(?!\.\.?$)[A-Za-z0-9_.-]+")  # a plain name inside the folder
_HEX = re.compile(r"[0-9a-f]{32}")
_READ_BYTES = 8 << 20


@dataclass(frozen=True)
class FileCheck:
    """One file of a checkpoint: its size in bytes and its xxh3-128 (None: format 1)."""

    size: int
    xxh3: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 0:
            raise ValueError(f"size must be an integer ≥ 0, got {self.size!r}")
        if self.xxh3 is not None and not (isinstance(self.xxh3, str) and _HEX.fullmatch(self.xxh3)):
            raise ValueError(f"xxh3 {self.xxh3!r} is not 32 hex digits ({CHECKSUM})")

    @classmethod
    def of(cls, data: bytes) -> FileCheck:
        """The check of a file whose whole content is `data`."""
        return cls(len(data), checksum(data))


@dataclass(frozen=True)
class CommittedRecord:
    """What `<checkpoint>/COMMITTED` says (see the module docstring).

    Invariants: step ≥ 0, world_size ≥ 1, epoch None or ≥ 0; every name in `files` is a plain
    file name of the checkpoint's own folder (no '/', '.' or '..': nothing outside it is ever
    read), and `learner_state.json` is one of them; either every file has an xxh3 (format 2)
    or none has and `learner_state_sha256` is set (format 1).
    """

    step: int
    world_size: int
    files: dict[str, FileCheck]
    epoch: int | None = None
    learner_state_sha256: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name, value, minimum in (("step", self.step, 0), ("world_size", self.world_size, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an integer ≥ {minimum}, got {value!r}")
        if self.epoch is not None and (
            isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 0
        ):
            raise ValueError(f"epoch must be an integer ≥ 0, got {self.epoch!r}")
        for name in self.files:
            if not isinstance(name, str) or not _FILE_NAME.fullmatch(name) or name == COMMITTED:
                raise ValueError(f"{name!r} is not a file name of the checkpoint's folder")
        if LEARNER_STATE not in self.files:
            raise ValueError(f"{LEARNER_STATE} is not listed")
        hashed = {check.xxh3 is not None for check in self.files.values()}
        if hashed == {True, False}:
            raise ValueError("some files have an xxh3 and some do not")
        if not self.checksummed and not self.learner_state_sha256:
            raise ValueError(f"a record without checksums needs {LEARNER_STATE}'s sha256")

    @property
    def checksummed(self) -> bool:
        """Every file has an xxh3 (format 2); else sizes only (format 1)."""
        return all(check.xxh3 is not None for check in self.files.values())

    def to_json(self) -> bytes:
        body: dict[str, Any] = {
            "format": FORMAT,
            "step": self.step,
            "world_size": self.world_size,
            "checksum": CHECKSUM,
            "files": {
                name: {"size": check.size, "xxh3": check.xxh3}
                for name, check in sorted(self.files.items())
            },
        }
        if self.epoch is not None:
            body["epoch"] = self.epoch
        return json.dumps(body, indent=2).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> CommittedRecord:
        """Raises `StorageError` naming `where` and what is wrong: the checkpoint is damaged."""
        try:
            body = json.loads(data)
            if body["format"] == 1:
                files = {name: FileCheck(size) for name, size in body["files"].items()}
                return cls(
                    body["step"], body["world_size"], files, None, body["learner_state_sha256"]
                )
            if body["format"] != FORMAT or body.get("checksum") != CHECKSUM:
                raise ValueError(f"unknown format {body['format']!r} / {body.get('checksum')!r}")
            files = {name: FileCheck(**check) for name, check in body["files"].items()}
            return cls(body["step"], body["world_size"], files, body.get("epoch"))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise StorageError(
                f"checkpoint {where} is damaged: its {COMMITTED} record is unreadable ({exc}); "
                "resume from an earlier checkpoint"
            ) from None

    def check_learner_state(self, data: bytes, where: str) -> None:
        """Raise `StorageError` unless `data` is the learner state this record committed."""
        expected = self.files[LEARNER_STATE]
        if self.checksummed:
            good = FileCheck.of(data) == expected
        else:
            good = hashlib.sha256(data).hexdigest() == self.learner_state_sha256
        if not good:
            raise StorageError(
                f"checkpoint {where} is damaged: {LEARNER_STATE} fails its "
                f"{'xxh3' if self.checksummed else 'sha256'} check; resume from an earlier "
                "checkpoint"
            )


def file_checksum(fs: AbstractFileSystem, path: str) -> str:
    """The xxh3-128 of the file at `path`, read in pieces (DCP shards can be many GB): equal to
    `storage.weights.manifest.checksum` of its whole content."""
    digest = xxhash.xxh3_128()
    with fs.open(path, "rb") as f:
        while piece := f.read(_READ_BYTES):
            digest.update(piece)
    return digest.hexdigest()


def stored_sizes(folder: Location) -> dict[str, int]:
    """Every file directly in `folder` but COMMITTED, with its size (one listing)."""
    entries = folder.fs.ls(folder.path, detail=True)
    sizes = {posixpath.basename(e["name"]): int(e["size"]) for e in entries if e["type"] == "file"}
    sizes.pop(COMMITTED, None)
    return sizes
