"""Where this learner process sits in the job: rank, world size, device, process group, mesh.

`Topology.from_env()` is the one place torch.distributed is initialised. Under torchrun it
reads RANK, WORLD_SIZE, LOCAL_RANK (and MASTER_ADDR/MASTER_PORT through `env://`). Started as a
plain process (no WORLD_SIZE), it still initialises a one-rank process group on an in-process
store, so a single process runs exactly the code of a multi-rank job: FSDP2, DCP checkpoints,
`full_state_dict` and every collective below. If torch.distributed is already initialised (an
embedding program did it), that group is adopted and left for its owner to destroy.

Backend: gloo on CPU, NCCL on CUDA (device `cuda:<LOCAL_RANK>`). The device mesh is 1-D
(`("fsdp",)`): every rank holds one shard of every parameter.

Rank-0-only work (logging, progress bars, writing files) is gated by `main_only`;
`decide_on_main` runs work on rank 0 and hands its result, or its error, to every rank;
`raise_flag` lets any rank tell rank 0 something (a stop signal that reached it alone) while
rank 0 waits for data and the others wait in a collective.

A learner process ends with `exit_process`, not by returning to the interpreter (see there).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from streamrl.placement.gpu_memory import cap_learner_memory

__all__ = ["Topology", "TopologyError", "exit_process"]

T = TypeVar("T")
MESH_DIM = "fsdp"


class TopologyError(RuntimeError):
    """The process cannot join the job as configured (device or launcher environment)."""


@dataclass(frozen=True)
class Topology:
    """This process's place in the learner job. Invariants: 0 ≤ rank < world_size;
    `device` is `cpu` (backend gloo) or `cuda:<local_rank>` (backend nccl); `mesh` spans all
    `world_size` ranks along one dimension named "fsdp"."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: Literal["gloo", "nccl"]
    mesh: DeviceMesh = field(repr=False, compare=False)
    owns_process_group: bool = field(default=True, repr=False, compare=False)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one rank that logs, writes files and decides for the others."""
        return self.rank == 0

    @classmethod
    def from_env(cls, device: Literal["auto", "cpu", "cuda"] = "auto") -> Topology:
        """Join the job torchrun started (or a one-rank job without torchrun) on `device`
        (`learner.device`; auto picks CUDA when available)."""
        rank, world_size, local_rank = _launcher_env()
        torch_device = _pick_device(device, local_rank)
        if torch_device.type == "cuda":  # on a GPU shared with engines: within its planned share
            cap_learner_memory(torch_device.index or 0)
        backend: Literal["gloo", "nccl"] = "nccl" if torch_device.type == "cuda" else "gloo"
        owns = not dist.is_initialized()
        if owns:
            extra: dict[str, Any] = {}
            if torch_device.type == "cuda":
                extra["device_id"] = torch_device
            if "WORLD_SIZE" not in os.environ:  # no launcher: a private one-rank store
                extra["store"] = dist.HashStore()
            dist.init_process_group(backend, rank=rank, world_size=world_size, **extra)
        elif (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise TopologyError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the environment says rank {rank} of {world_size}; "
                "initialise it from the same RANK/WORLD_SIZE or let the learner do it"
            )
        mesh = init_device_mesh(torch_device.type, (world_size,), mesh_dim_names=(MESH_DIM,))
        return cls(rank, world_size, local_rank, torch_device, backend, mesh, owns)

    # -- rank-0 gating ---------------------------------------------------------------------

    def main_only(self, fn: Callable[[], T]) -> T | None:
        """`fn()` on the main rank, None elsewhere. No collective: other ranks do not wait."""
        return fn() if self.is_main else None

    def decide_on_main(self, fn: Callable[[], T]) -> T:
        """Run `fn()` on the main rank and return its result on every rank (a collective).

        If `fn` raises on the main rank, it re-raises there and every other rank raises a
        `RuntimeError` naming it, instead of waiting forever at the next collective."""
        if self.world_size == 1:
            return fn()
        box: list[Any] = [None]
        error: BaseException | None = None
        if self.is_main:
            try:
                box[0] = ("ok", fn())
            except Exception as exc:  # re-raised below, after the other ranks have been told
                error, box[0] = exc, ("error", f"{type(exc).__name__}: {exc}")
        dist.broadcast_object_list(box, src=0)
        if error is not None:
            raise error
        kind, payload = box[0]
        if kind == "error":
            raise RuntimeError(f"rank 0 failed: {payload}")
        return payload

    # -- flags: any rank to the main rank, without a collective -----------------------------

    def raise_flag(self, name: str) -> None:
        """Tell the main rank `name` (`flag_raised`), from any thread of any rank: a key in
        the job's store (torchrun's rendezvous store), which needs no collective."""
        if self.world_size > 1:
            _store().set(f"streamrl/{name}", b"1")

    def flag_raised(self, name: str) -> bool:
        """Whether any rank raised flag `name` (asked on the main rank; no collective)."""
        return self.world_size > 1 and _store().check([f"streamrl/{name}"])

    # -- collectives (no-ops with one rank) -------------------------------------------------

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        if self.world_size > 1:
            dist.barrier(device_ids=[self.local_rank] if self.backend == "nccl" else None)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of `tensor` over ranks, as a new tensor on `tensor`'s device
        (shape and dtype unchanged; the input is not modified)."""
        if self.world_size == 1:
            return tensor.clone()
        summed = tensor.detach().to(self.device, copy=True)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        return summed.to(tensor.device)

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise maximum of `tensor` over ranks, as `all_reduce_sum` returns."""
        if self.world_size == 1:
            return tensor.clone()
        top = tensor.detach().to(self.device, copy=True)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        return top.to(tensor.device)

    def broadcast_object(self, obj: T, src: int = 0) -> T:
        """`obj` as rank `src` has it, on every rank (picklable objects only)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def destroy(self) -> None:
        """Tear down the process group if `from_env` created it (idempotent)."""
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> Topology:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.destroy()


def _launcher_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's variables; (0, 1, 0) without them."""
    if "WORLD_SIZE" not in os.environ:
        return 0, 1, 0
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise TopologyError(
            f"WORLD_SIZE is set but {', '.join(missing)} is not; launch the learner with "
            "torchrun (`torchrun --nproc_per_node N -m streamrl learner ...`), or unset "
            "WORLD_SIZE to run one process"
        )
    try:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    except ValueError as exc:
        raise TopologyError(f"RANK/WORLD_SIZE/LOCAL_RANK must be integers: {exc}") from None
    if not 0 <= rank < world_size:
        raise TopologyError(f"RANK={rank} is outside [0, WORLD_SIZE={world_size})")
    return rank, world_size, local_rank


def _pick_device(device: str, local_rank: int) -> torch.device:
    if device not in ("auto", "cpu", "cuda"):
        raise TopologyError(f"learner.device must be auto, cpu or cuda, not {device!r}")
    cuda = torch.cuda.is_available()
    if device == "cpu" or (device == "auto" and not cuda):
        return torch.device("cpu")
    if not cuda:
        raise TopologyError(
            "learner.device is cuda but no CUDA device is visible (torch.cuda.is_available() "
            "is False); set learner.device=cpu or auto"
        )
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise TopologyError(
            f"LOCAL_RANK {local_rank} has no GPU: this node sees {count}; set "
            f"learner.nproc_per_node ≤ {count}"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _store() -> dist.Store:
    # The default group's store: torch.distributed exposes it under this name only.
    return dist.distributed_c10d._get_default_store()


def exit_process(code: int) -> NoReturn:
    """End this process with `code` after its exit handlers, without finalizing the interpreter.

    For a program that used torch.distributed (the learner's ranks). gloo's worker threads
    outlive `destroy_process_group` (device meshes keep the group alive) and free a
    collective's tensors just after the caller saw it complete. Freeing a tensor Python created
    takes the GIL, and a thread that gets the GIL while the interpreter finalizes is ended by
    Python (`pthread_exit`) from inside a C++ destructor that must not unwind: `std::terminate`,
    SIGABRT, after a run that succeeded (pytorch/pytorch#190489). So the exit handlers
    (logging, wandb, temporary files) run while the interpreter is whole, output is flushed,
    and the process leaves with `os._exit`. Threads still running are not waited for."""
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # closed, or its reader gone
                stream.flush()
        os._exit(code)
