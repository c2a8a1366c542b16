"""Learner checkpoints: `<run>/checkpoints/step-<n:08d>/`, saved and loaded with DCP.

One checkpoint folder holds

    __<rank>_0.distcp       DCP shards, one file per rank: model, optimiser, value model, ...
    .metadata               DCP's index of the shards (written by DCP's coordinator, rank 0)
    learner_state.json      {"format", "world_size", "learner": LearnerState, "rng": [per rank]}
    COMMITTED               written LAST by rank 0, after a barrier:
                            {"format", "step", "world_size", "learner_state_sha256",
                             "files": {name: size in bytes}}

Invariants:
- A checkpoint exists only once COMMITTED does; readers ignore folders without it (a learner
  that died mid-save leaves one, removed by `retain` or overwritten by the next save of that
  step). A committed checkpoint is never modified; deleting one removes COMMITTED first.
- `load` trusts only what COMMITTED names: every listed file must be there with its size, and
  learner_state.json must match its sha256.
- RNG states (python, numpy, torch, and CUDA when in use) are captured per rank when `save`
  starts and restored per rank by `load`, which therefore needs the same world size (model
  and optimiser shards themselves reshard freely; pass `restore_rng=False` to resume on a
  different world size).

Distributed use: with torch.distributed initialised, `save`, `load`, `committed_steps`,
`latest_committed` and `retain` are collectives — call them on every rank. Rank 0 alone
decides (lists, deletes, commits) and broadcasts the outcome, so every rank returns the same
answer or raises the same error. Without torch.distributed they work in one process.
FSDP2 (`fully_shard`) models save sharded: wrap model and optimiser in `ModelState`, which
uses DCP's `get_state_dict` / `set_state_dict`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import posixpath
import random
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from storage.fs import Location, StorageError, put_if_absent

__all__ = ["CheckpointStore", "LearnerState", "ModelState", "step_dirname"]

COMMITTED = "COMMITTED"
LEARNER_STATE = "learner_state.json"
_FORMAT = 1
_STEP_DIR = re.compile(r"step-(\d{8})")
T = TypeVar("T")


def step_dirname(step: int) -> str:
    """Folder name of the checkpoint taken after `step` optimiser steps."""
    return f"step-{step:08d}"


@dataclass(frozen=True)
class LearnerState:
    """Where the learner stands, saved with every checkpoint (the same on every rank).

    Invariants: `step` ≥ 0 is the number of optimiser steps completed and names the
    checkpoint folder; `policy_version` ≥ 0 counts weight publications so far; `stream_cursor`
    (the replay-stream reader's position, opaque here) and `extra` are JSON-able dicts and
    come back as JSON parses them (tuples as lists).
    """

    step: int
    policy_version: int
    stream_cursor: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.step < 0 or self.policy_version < 0:
            raise ValueError(
                f"step ({self.step}) and policy_version ({self.policy_version}) must be ≥ 0"
            )
        try:
            json.dumps([self.stream_cursor, self.extra], allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"stream_cursor and extra must be plain JSON: {exc}") from None


class ModelState(Stateful):
    """A model and (optionally) its optimiser as one DCP entry, FSDP2-aware."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        options: StateDictOptions | None = None,
    ) -> None:
        self.model, self.optimizer, self.options = model, optimizer, options

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model, options=self.options)}
        model, optim = get_state_dict(self.model, self.optimizer, options=self.options)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        model, options = state_dict["model"], self.options
        if self.optimizer is None:
            set_model_state_dict(self.model, model, options=options)
        else:
            optim = state_dict["optim"]
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=model,
                optim_state_dict=optim,
                options=options,
            )


class CheckpointStore:
    """The checkpoints of one run, under `<run>/checkpoints/`."""

    def __init__(self, run: Location) -> None:
        self.location = run.child("checkpoints")

    def save(self, app_state: dict[str, Any], state: LearnerState) -> None:
        """Save `app_state` (name → `Stateful` or state dict) as checkpoint `state.step`.

        Raises `StorageError` if that step is already committed.
        """
        folder = self.location.child(step_dirname(state.step))
        per_rank = _all_gather({"learner": asdict(state), "rng": _capture_rng()})
        _on_rank0(lambda: self._prepare(folder, state, [got["learner"] for got in per_rank]))
        writer = FsspecWriter(folder.uri, sync_files=folder.is_local, **folder.storage_options())
        with _single_process_is_intended():
            dcp.save(app_state, storage_writer=writer)
        _barrier()
        _on_rank0(lambda: self._commit(folder, state, [got["rng"] for got in per_rank]))

    def load(
        self, step: int, app_state: dict[str, Any], *, restore_rng: bool = True
    ) -> LearnerState:
        """Load committed checkpoint `step` into `app_state` in place; restore RNG states.

        Raises `StorageError` if `step` is not committed (naming those that are), if the
        checkpoint is damaged, or if `restore_rng` and the world size differs from the saved one.
        """
        folder = self.location.child(step_dirname(step))
        body = _on_rank0(lambda: self._verified_state(folder, step))
        world = dist.get_world_size() if _distributed() else 1
        if restore_rng and body["world_size"] != world:
            raise StorageError(
                f"checkpoint {folder.uri} was saved by {body['world_size']} ranks, this job has "
                f"{world}; RNG states are per rank. Resume with the same world size or load "
                "with restore_rng=False"
            )
        reader = FsspecReader(folder.uri, **folder.storage_options())
        with _single_process_is_intended():
            dcp.load(app_state, storage_reader=reader)
        if restore_rng:
            _restore_rng(body["rng"][_rank()])
        return LearnerState(**body["learner"])

    def read_state(self, step: int) -> LearnerState:
        """The learner state of committed checkpoint `step`, verified, without loading any
        tensors: check it before `load` (a collective, like `load`)."""
        folder = self.location.child(step_dirname(step))
        return LearnerState(**_on_rank0(lambda: self._verified_state(folder, step))["learner"])

    def committed_steps(self) -> list[int]:
        """Steps with a committed checkpoint, oldest first."""
        return _on_rank0(lambda: sorted(s for s, done in self._scan().items() if done))

    def latest_committed(self) -> int | None:
        """The newest committed step, or None when there is none."""
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def retain(self, keep: int) -> list[int]:
        """Keep the newest `keep` committed checkpoints; delete older ones and uncommitted
        folders older than the newest committed one. Returns the deleted steps."""
        if keep < 1:
            raise ValueError(f"keep must be ≥ 1 (got {keep}); the newest checkpoint is kept")
        return _on_rank0(lambda: self._retain(keep))

    # -- rank 0 only ---------------------------------------------------------------------

    def _scan(self) -> dict[int, bool]:
        """step → committed, for every step folder holding at least one object.

        One recursive listing of objects: folders some S3 servers still list after their
        objects were deleted do not count."""
        root = self.location.path.rstrip("/") + "/"
        try:
            paths = self.location.fs.find(self.location.path)
        except FileNotFoundError:
            return {}
        steps: dict[int, bool] = {}
        for path in paths:
            folder, _, name = path.removeprefix(root).partition("/")
            match = _STEP_DIR.fullmatch(folder)
            if match and name:
                step = int(match.group(1))
                steps[step] = steps.get(step, False) or name == COMMITTED
        return steps

    def _prepare(self, folder: Location, state: LearnerState, per_rank: list[Any]) -> None:
        differing = [rank for rank, got in enumerate(per_rank) if got != asdict(state)]
        if differing:
            raise StorageError(
                f"the learner state passed to save() differs between ranks (rank 0 vs ranks "
                f"{differing}); it must be the same everywhere, only rank 0's is written"
            )
        fs = folder.fs
        if fs.exists(folder.join(COMMITTED)):
            raise StorageError(
                f"checkpoint {folder.uri} is already committed; checkpoints are never "
                f"overwritten (resume from it, or delete it to take step {state.step} again)"
            )
        if fs.exists(folder.path):  # left by a save that died: start from an empty folder
            fs.rm(folder.path, recursive=True)

    def _commit(self, folder: Location, state: LearnerState, rng: list[dict[str, Any]]) -> None:
        body = {"format": _FORMAT, "world_size": len(rng), "learner": asdict(state), "rng": rng}
        learner_bytes = json.dumps(body, sort_keys=True).encode()
        folder.fs.pipe_file(folder.join(LEARNER_STATE), learner_bytes)
        files = _file_sizes(folder)
        record = {
            "format": _FORMAT,
            "step": state.step,
            "world_size": len(rng),
            "learner_state_sha256": hashlib.sha256(learner_bytes).hexdigest(),
            "files": dict(sorted(files.items())),
        }
        data = json.dumps(record, indent=2).encode()
        created = put_if_absent(folder.fs, folder.join(COMMITTED), data)
        if not created and folder.fs.cat_file(folder.join(COMMITTED)) != data:  # not a retry
            raise StorageError(f"{folder.uri} was committed by another writer meanwhile")

    def _verified_state(self, folder: Location, step: int) -> dict[str, Any]:
        fs = folder.fs
        if not fs.exists(folder.join(COMMITTED)):
            committed = sorted(s for s, done in self._scan().items() if done)
            raise StorageError(
                f"no committed checkpoint for step {step} at {self.location.uri} "
                f"({folder.join(COMMITTED)} not found); committed steps: "
                f"{committed or 'none'}. Resume from one of them (latest_committed())"
            )
        record = json.loads(fs.cat_file(folder.join(COMMITTED)))
        present = _file_sizes(folder)
        for name, size in record["files"].items():
            if present.get(name) != size:
                raise StorageError(
                    f"checkpoint {folder.uri} is damaged: {name} has "
                    f"{present.get(name, 'no')} bytes, COMMITTED says {size}; resume from an "
                    "earlier checkpoint"
                )
        learner_bytes = fs.cat_file(folder.join(LEARNER_STATE))
        if hashlib.sha256(learner_bytes).hexdigest() != record["learner_state_sha256"]:
            raise StorageError(
                f"checkpoint {folder.uri} is damaged: {LEARNER_STATE} fails its sha256 check"
            )
        return json.loads(learner_bytes)

    def _retain(self, keep: int) -> list[int]:
        steps = self._scan()
        committed = sorted(s for s, done in steps.items() if done)
        doomed = set(committed[:-keep])
        if committed:
            doomed |= {s for s, done in steps.items() if not done and s < committed[-1]}
        fs = self.location.fs
        for step in sorted(doomed):
            folder = self.location.child(step_dirname(step))
            if steps[step]:  # uncommit first: a crash mid-delete leaves only garbage
                fs.rm_file(folder.join(COMMITTED))
            fs.rm(folder.path, recursive=True)
        return sorted(doomed)


def _file_sizes(folder: Location) -> dict[str, int]:
    entries = folder.fs.ls(folder.path, detail=True)
    return {posixpath.basename(e["name"]): int(e["size"]) for e in entries if e["type"] == "file"}


# -- distributed helpers ---------------------------------------------------------------------


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


@contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """Without torch.distributed, DCP warns that it assumes one process: here that is meant."""
    with warnings.catch_warnings():
        if not _distributed():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _all_gather(value: dict[str, Any]) -> list[dict[str, Any]]:
    if not _distributed():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _on_rank0(decide: Callable[[], T]) -> T:
    """Run `decide` on rank 0 only and hand its result, or its error, to every rank."""
    if not _distributed():
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


# -- RNG states ----------------------------------------------------------------------------


def _capture_rng() -> dict[str, Any]:
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


def _restore_rng(state: dict[str, Any]) -> None:
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
