"""What checkpoints need of torch.distributed and of the random number generators.

Rank 0 alone decides (lists, deletes, commits) and hands its result, or its error, to every
rank (`on_rank0`), so every rank returns the same answer or raises the same error; the ranks
share the hashing of a checkpoint's files (`hash_share`). Without torch.distributed each helper
works in one process. RNG states (python, numpy, torch, and CUDA when in use) are captured and
restored per rank as plain JSON.
"""

from __future__ import annotations

import base64
import random
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from storage.checkpoints.record import file_checksum
from storage.fs import Location, StorageError

__all__ = [
    "all_gather",
    "barrier",
    "capture_rng_state",
    "distributed",
    "hash_share",
    "on_rank0",
    "rank",
    "restore_rng_state",
    "single_process_is_intended",
    "world_size",
]

T = TypeVar("T")


def world_size() -> int:
    return dist.get_world_size() if distributed() else 1


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def barrier() -> None:
    if distributed():
        dist.barrier()


@contextmanager
def single_process_is_intended() -> Iterator[None]:
    """Without torch.distributed, DCP warns that it assumes one process: here that is meant."""
    with warnings.catch_warnings():
        if not distributed():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def all_gather(value: dict[str, Any]) -> list[dict[str, Any]]:
    if not distributed():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def on_rank0(decide: Callable[[], T]) -> T:
    """Run `decide` on rank 0 only and hand its result, or its error, to every rank."""
    if not distributed():
        return decide()
    box: list[Any] = [None]
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", decide())
        except Exception as exc:  # re-raised below, after the other ranks have been told
            error = exc
            box[0] = ("storage" if isinstance(exc, StorageError) else "error", str(exc))
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    kind, payload = box[0]
    if kind == "storage":
        raise StorageError(payload)
    if kind == "error":
        raise RuntimeError(f"rank 0 failed while handling a checkpoint: {payload}")
    return payload


def capture_rng_state() -> dict[str, Any]:
    version, mt_state, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": [version, list(mt_state), gauss_next],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached_gaussian)],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = _b64(torch.cuda.get_rng_state())
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    version, mt_state, gauss_next = state["python"]
    random.setstate((version, tuple(mt_state), gauss_next))
    kind, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached_gaussian))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_unb64(state["cuda"]))


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode()


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def hash_share(folder: Location, names: list[str]) -> dict[str, str | None]:
    """name → xxh3 of every file in `names` (None: missing), each rank hashing every
    world_size-th one (a collective). A failed read raises `OSError` on every rank."""
    me, world = rank(), world_size()
    mine: dict[str, str | None] = {}
    error = None
    for name in names[me::world]:
        try:
            mine[name] = file_checksum(folder.fs, folder.join(name))
        except FileNotFoundError:
            mine[name] = None
        except Exception as exc:  # handed to every rank below, then raised
            error = f"rank {me} reading {folder.join(name)}: {exc!r}"
            break
    gathered = all_gather({"hashes": mine, "error": error})
    errors = [got["error"] for got in gathered if got["error"]]
    if errors:
        raise OSError(f"hashing the files of checkpoint {folder.uri} failed: {errors[0]}")
    return {name: h for got in gathered for name, h in got["hashes"].items()}
