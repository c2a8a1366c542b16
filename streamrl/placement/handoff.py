"""Weights handed from the learner to the engines placed beside it, without storage in between.

When a generator holds the learner's GPU (`placement.share_gpus`, or fewer GPUs than processes),
the bytes of a new policy version need not travel to storage and back: the learner leaves each
published version in a *slot* on its own device, and the engine copies it from there into its
parameters (device to device). Storage is still written exactly as before — it is what resume,
the evaluator and every other generator read — and it stays the authority: an engine takes a
version only once it is committed there (`storage.weights`), and takes it from the hand-off only
when the slot holds that very publish (same version, same publish id as the committed
manifest, the manifest's dtypes and shapes); otherwise it reads storage as usual.

Layout: one directory per run on this machine (`handoff_dir`, in `/dev/shm`), readable by the
run's user only, with two slots per learner rank — version v goes to slot v % 2, so the last
committed version stays whole while the next one is written:

    rank<r>-slot<k>.json   the header: state, version, publish id, this rank's pieces
    rank<r>-slot<k>.data   the bytes, on CPU (a file of shared memory, mapped by both sides)

On CUDA the bytes stay in the learner's GPU memory and the header carries a CUDA IPC handle of
them instead (opened once per learner life by each reader). Each piece is a range of a
tensor's flattened elements, as in the weight store: a learner of several ranks leaves each
rank's FSDP2 shard, and the reader puts them together.

Consistency (a seqlock on the header): before touching a slot's bytes the writer replaces its
header with a `writing` one, and after the bytes are written (the device synchronised) with the
complete one; headers are replaced atomically (rename). A reader takes a version when every
rank's header names it, loads it, then reads the headers again (`Taken.intact`): any change
means the load may be torn, and the reader loads the version from storage instead. A header
also names its writer's process, which must still run (on CUDA a dead learner's memory is
gone, whatever its header says). Two slots
make that rare: the learner overwrites version v's slot only when publishing v + 2, after v + 1
was committed.

The directory is removed when the run's supervisor exits; a learner life removes its own
files when it closes. Memory: two slots of each rank's shard in `weights.dtype` on the
learner's device (`streamrl.placement.gpu_memory` plans them on a shared GPU).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from storage.weights.manifest import WeightManifest, publish_of
from streamrl.placement.records import HANDOFF_VARIABLE

__all__ = [
    "HANDOFF_VARIABLE",
    "HandOffReader",
    "HandOffWriter",
    "Taken",
    "handoff_dir",
    "remove_handoff",
]


log = logging.getLogger(__name__)

HEADER_FORMAT = "streamrl.handoff.v1"
SLOTS = 2
_ALIGN = 64  # every piece starts on a 64-byte boundary: a view of any dtype is aligned

Shares = Mapping[str, tuple[torch.Tensor, int, tuple[int, ...]]]  # name → (local, start, shape)


def handoff_dir(run_uri: str) -> Path:
    """The hand-off directory of the run at `run_uri` on this machine (shared memory when the
    machine has it)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    digest = hashlib.sha256(run_uri.encode()).hexdigest()[:16]
    return base / f"streamrl-handoff-{digest}"


def remove_handoff(run_uri: str) -> None:
    """Remove the run's hand-off directory (its supervisor, on exit)."""
    shutil.rmtree(handoff_dir(run_uri), ignore_errors=True)


def _slot_name(rank: int, slot: int) -> str:
    return f"rank{rank:05d}-slot{slot}"


def _write_header(path: Path, header: dict[str, Any]) -> None:
    """Replace the header at `path` atomically."""
    temporary = path.with_suffix(f".tmp{os.getpid()}")
    temporary.write_text(json.dumps(header))
    os.replace(temporary, path)


def _read_header(path: Path) -> dict[str, Any] | None:
    try:
        header = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return header if isinstance(header, dict) and header.get("format") == HEADER_FORMAT else None


@dataclass(frozen=True)
class _Piece:
    name: str
    start: int
    stop: int
    dtype: str
    shape: tuple[int, ...]
    offset: int  # bytes into the slot

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * getattr(torch, self.dtype).itemsize


class HandOffWriter:
    """The learner rank's side: `write` each published version into its slot."""

    def __init__(self, directory: Path, rank: int, world: int, device: torch.device) -> None:
        self.directory, self.rank, self.world, self.device = directory, rank, world, device
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)  # an engine of another user has no business here
        self._layout: list[_Piece] = []
        self._slots: list[torch.Tensor] = []
        self._transport: list[dict[str, Any]] = []
        self.off = False  # the slots could not be had: storage only, for this life

    @classmethod
    def if_placed(
        cls, run_uri: str, rank: int, world: int, device: torch.device
    ) -> HandOffWriter | None:
        """This learner rank's writer when the placement put engines beside it (the
        `HANDOFF_VARIABLE` in its environment), else None."""
        if os.environ.get(HANDOFF_VARIABLE) != "1":
            return None
        return cls(handoff_dir(run_uri), rank, world, device)

    def write(
        self, version: int, publish_id: str, shares: Shares, dtype: torch.dtype
    ) -> float | None:
        """Leave this rank's `shares` of `version` (floating tensors cast to `dtype`) in slot
        `version % 2`; the seconds taken. When the slots cannot be had (shared memory or GPU
        memory short), the hand-off is off for this life — said once, the engines read storage
        — and None is returned: the learner never fails for it."""
        if self.off:
            return None
        started = time.perf_counter()
        layout = self._plan(shares, dtype)
        if layout != self._layout:
            try:
                self._allocate(layout)
            except (OSError, torch.OutOfMemoryError) as exc:
                self.close()
                self.off = True
                log.warning(
                    "the weight hand-off is off for this learner life: its slots (%.0f MB each, "
                    "in %s) could not be had: %s. Generators read every version from storage; "
                    "give the machine more shared memory (Docker: --shm-size) or the learner "
                    "more of the GPU, or set weights.handoff=false",
                    _slot_bytes(layout) / 1e6, self.directory, exc,
                )  # fmt: skip
                return None
        slot = version % SLOTS
        header_path = self.directory / f"{_slot_name(self.rank, slot)}.json"
        _write_header(header_path, {"format": HEADER_FORMAT, "state": "writing"})
        buffer = self._slots[slot]
        for piece in layout:
            local = shares[piece.name][0].detach().reshape(-1)
            target = buffer[piece.offset : piece.offset + piece.nbytes]
            target.view(getattr(torch, piece.dtype)).copy_(local)  # casts to weights.dtype
        if buffer.device.type == "cuda":
            torch.cuda.synchronize(buffer.device)
        _write_header(
            header_path,
            {
                "format": HEADER_FORMAT,
                "state": "ready",
                "version": version,
                "publish_id": publish_id,
                "rank": self.rank,
                "world": self.world,
                "pid": os.getpid(),
                "nbytes": buffer.numel(),
                "pieces": [
                    [p.name, p.start, p.stop, p.dtype, list(p.shape), p.offset] for p in layout
                ],
                **self._transport[slot],
            },
        )
        return time.perf_counter() - started

    def close(self) -> None:
        """Remove this rank's slots (the engines read storage from now on)."""
        for slot in range(SLOTS):
            for suffix in (".json", ".data"):
                with contextlib.suppress(FileNotFoundError):
                    (self.directory / f"{_slot_name(self.rank, slot)}{suffix}").unlink()
        self._slots, self._transport, self._layout = [], [], []

    def _plan(self, shares: Shares, dtype: torch.dtype) -> list[_Piece]:
        layout, offset = [], 0
        for name, (local, start, shape) in shares.items():
            if not local.numel():
                continue
            kept = dtype if local.is_floating_point() else local.dtype
            piece = _Piece(name, start, start + local.numel(), str(kept).removeprefix("torch."),
                           tuple(shape), offset)  # fmt: skip
            layout.append(piece)
            offset += -(-piece.nbytes // _ALIGN) * _ALIGN
        return layout

    def _allocate(self, layout: list[_Piece]) -> None:
        """Fresh slots for `layout` (the first version of this life): new files, so a reader
        still mapping a former life's never sees them change."""
        self.close()
        nbytes = _slot_bytes(layout)
        for slot in range(SLOTS):
            name = _slot_name(self.rank, slot)
            if self.device.type == "cuda":
                buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                transport = {"transport": "cuda", "cuda": _export_cuda(buffer)}
            else:
                path = self.directory / f"{name}.data"
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                try:  # reserved now: a full /dev/shm fails here, never as SIGBUS in a write
                    os.posix_fallocate(fd, 0, nbytes)
                finally:
                    os.close(fd)
                buffer = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
                transport = {"transport": "host", "data": path.name}
            self._slots.append(buffer)
            self._transport.append(transport)
        self._layout = layout


def _slot_bytes(layout: list[_Piece]) -> int:
    return max(1, sum(-(-p.nbytes // _ALIGN) * _ALIGN for p in layout))


class Taken:
    """A version taken from the hand-off: its tensors (views into the slots where a tensor is
    one piece) and whether the slots still held it after it was used (`intact`)."""

    def __init__(self, reader: HandOffReader, version: int, headers: dict[Path, dict[str, Any]],
                 tensors: dict[str, torch.Tensor]) -> None:  # fmt: skip
        self.reader, self.version, self._headers, self._tensors = reader, version, headers, tensors

    def tensors(self) -> dict[str, torch.Tensor]:
        return self._tensors

    def intact(self) -> bool:
        """True when no slot was touched since this version was taken: a load from it is whole.
        Call it after the load finished (on CUDA, after the copy synchronised)."""
        return all(
            _read_header(path) == header and _alive(header.get("pid"))
            for path, header in self._headers.items()
        )


class HandOffReader:
    """An engine worker's side: `take` a committed version from the learner's slots."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._mapped: dict[tuple[str, str], torch.Tensor] = {}  # (slot, publish id) → bytes

    def take(self, manifest: WeightManifest, device: torch.device) -> Taken | None:
        """The version `manifest` commits, as the learner left it, on `device`; None when the
        slots do not hold exactly that publish (then read storage)."""
        version = manifest.version
        publish_ids = {publish_of(f.file) for f in manifest.files}
        if len(publish_ids) != 1:
            return None
        publish_id = publish_ids.pop()
        slot = version % SLOTS
        first = self.directory / f"{_slot_name(0, slot)}.json"
        header = _read_header(first)
        if header is None or not _ready(header, version, publish_id):
            return None
        world = header.get("world")
        if not isinstance(world, int) or world < 1:
            return None
        headers = {first: header}
        for rank in range(1, world):
            path = self.directory / f"{_slot_name(rank, slot)}.json"
            other = _read_header(path)
            if other is None or not _ready(other, version, publish_id):
                return None
            headers[path] = other
        pieces: dict[str, list[tuple[_Piece, torch.Tensor]]] = {}
        for path, header in headers.items():
            buffer = self._open(path, header, publish_id, device)
            if buffer is None:
                return None
            for raw in header["pieces"]:
                try:
                    piece = _Piece(str(raw[0]), int(raw[1]), int(raw[2]), str(raw[3]),
                                   tuple(int(d) for d in raw[4]), int(raw[5]))  # fmt: skip
                    fits = piece.offset >= 0 and piece.offset + piece.nbytes <= buffer.numel()
                except (IndexError, TypeError, ValueError, AttributeError):
                    return None
                if not fits or piece.stop <= piece.start:
                    return None
                data = buffer[piece.offset : piece.offset + piece.nbytes]
                pieces.setdefault(piece.name, []).append((piece, data))
        tensors = _assemble(manifest, pieces, device)
        return None if tensors is None else Taken(self, version, headers, tensors)

    def _open(self, path: Path, header: dict[str, Any], publish_id: str,
              device: torch.device) -> torch.Tensor | None:  # fmt: skip
        key = (path.name, publish_id)
        if key not in self._mapped:
            for stale in [k for k in self._mapped if k[0] == path.name]:
                del self._mapped[stale]  # a former learner life's slot
            try:
                if header.get("transport") == "cuda":
                    buffer = _import_cuda(header["cuda"], device)
                else:
                    data = self.directory / str(header["data"])
                    nbytes = int(header["nbytes"])
                    if data.name != header["data"] or data.stat().st_size < nbytes:
                        return None
                    buffer = torch.from_file(str(data), shared=True, size=nbytes,
                                             dtype=torch.uint8)  # fmt: skip
            except (OSError, RuntimeError, KeyError, TypeError, ValueError):
                return None
            if buffer is None:
                return None
            self._mapped[key] = buffer
        return self._mapped[key]


def _ready(header: dict[str, Any], version: int, publish_id: str) -> bool:
    return (
        header.get("state") == "ready"
        and header.get("version") == version
        and header.get("publish_id") == publish_id
        and isinstance(header.get("pieces"), list)
        and _alive(header.get("pid"))
    )


def _alive(pid: Any) -> bool:
    """Whether the learner process that wrote a header still runs: a dead one's GPU memory is
    gone (CUDA IPC), whatever its header says."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _assemble(
    manifest: WeightManifest,
    pieces: dict[str, list[tuple[_Piece, torch.Tensor]]],
    device: torch.device,
) -> dict[str, torch.Tensor] | None:
    """Every tensor of `manifest` from the pieces the ranks left: a view of the slot when one
    piece holds the whole tensor, else a new tensor the pieces are copied into. None when the
    pieces do not match the manifest (dtype, shape, coverage)."""
    if set(pieces) != set(manifest.tensors):
        return None
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in manifest.tensors.items():
        found = sorted(pieces[name], key=lambda p: p[0].start)
        covered = 0
        for piece, _ in found:
            if piece.dtype != entry.dtype or piece.shape != entry.shape or piece.start != covered:
                return None
            covered = piece.stop
        if covered != entry.numel:
            return None
        dtype = entry.torch_dtype
        if len(found) == 1:
            tensors[name] = found[0][1].view(dtype).view(entry.shape)
            continue
        whole = torch.empty(entry.numel, dtype=dtype, device=device)
        for piece, data in found:
            whole[piece.start : piece.stop].copy_(data.view(dtype))
        tensors[name] = whole.view(entry.shape)
    return tensors


def _export_cuda(buffer: torch.Tensor) -> dict[str, Any]:
    """What another process needs to open `buffer` (CUDA IPC, as torch.multiprocessing shares
    a tensor), as JSON-able values; the GPU named by its UUID, since the two processes may
    number their visible devices differently."""
    (device, handle, size, offset, counter, counter_offset, event, event_sync) = (
        buffer.untyped_storage()._share_cuda_()
    )
    return {
        "uuid": str(torch.cuda.get_device_properties(device).uuid),
        "handle": _b64(handle),
        "size": size,
        "offset": offset,
        "ref_counter": _b64(counter),
        "ref_counter_offset": counter_offset,
        "event": _b64(event),
        "event_sync": bool(event_sync),
    }


def _import_cuda(shared: dict[str, Any], device: torch.device) -> torch.Tensor | None:
    """The learner's slot opened in this process: on the visible GPU with the same UUID."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    index = next(
        (i for i in range(torch.cuda.device_count())
         if str(torch.cuda.get_device_properties(i).uuid) == shared["uuid"]),
        None,
    )  # fmt: skip
    if index is None or (device.type == "cuda" and device.index not in (None, index)):
        return None
    return rebuild_cuda_tensor(
        torch.Tensor, (int(shared["size"]),), (1,), 0, torch.storage.TypedStorage, torch.uint8,
        index, _unb64(shared["handle"]), int(shared["size"]), int(shared["offset"]), False,
        _unb64(shared["ref_counter"]), int(shared["ref_counter_offset"]),
        _unb64(shared["event"]), bool(shared["event_sync"]),
    )  # fmt: skip


def _b64(value: bytes | None) -> str | None:
    return None if value is None else base64.b64encode(value).decode()


def _unb64(value: str | None) -> bytes | None:
    return None if value is None else base64.b64decode(value)
