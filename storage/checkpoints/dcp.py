"""Learner checkpoints: `<run>/checkpoints/step-<n:08d>/`, saved and loaded with DCP.

One checkpoint folder holds

    __<rank>_0.distcp       DCP shards, one file per rank: model, optimiser, value model, ...
    .metadata               DCP's index of the shards (written by DCP's coordinator, rank 0)
    learner_state.json      {"format", "world_size", "learner": LearnerState, "rng": [per rank]}
    COMMITTED               written LAST by rank 0: every other file with its size and xxh3,
                            hashed as it was written (`storage.checkpoints.writer`: a save reads
                            nothing back), and the writer's lease epoch (`CommittedRecord`)

Invariants:
- A checkpoint exists only once COMMITTED does; readers ignore folders without it (a learner
  that died mid-save leaves one, removed by `retain` or overwritten by the next save of that
  step). A committed checkpoint is never modified; deleting one removes COMMITTED first.
- `load` trusts only what COMMITTED names, in the checkpoint's own folder: every listed file
  must be there with its size and xxh3. `latest_verified` is the checkpoint to resume from:
  the newest that passes; one that fails is reported (logged, `damaged`) and passed over for
  the previous one, from which the resume is exact. A checkpoint committed before checksums
  is checked by sizes only (and says so in a log line).
- Trust model: whoever can write the run's storage can run code in the learner (DCP's
  `.metadata` and non-tensor entries are pickles); checksums guard against corruption, not
  against an attacker.
- With a `fence` (the learner's lease, `storage.control.fencing.Fence`), `fence.check()` is called
  right before COMMITTED is written and before each deletion; its epoch is recorded.
- RNG states (python, numpy, torch, and CUDA when in use) are captured per rank when `save`
  starts and restored per rank by `load`, which therefore needs the same world size (model
  and optimiser shards themselves reshard freely; pass `restore_rng=False` to resume on a
  different world size).

Distributed use: with torch.distributed initialised, `save`, `load`, `read_state`,
`committed_steps`, `latest_committed`, `latest_verified` and `retain` are collectives — call
them on every rank. Rank 0 alone decides (lists, deletes, commits) and broadcasts the outcome,
so every rank returns the same answer or raises the same error; the ranks share the hashing of
the files on resume (`storage.checkpoints.ranks`). Without torch.distributed: one process.
FSDP2 (`fully_shard`) models save sharded: wrap model and optimiser in `ModelState`, which
uses DCP's `get_state_dict` / `set_state_dict`.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from storage.checkpoints.ranks import (
    all_gather,
    capture_rng_state,
    hash_share,
    on_rank0,
    rank,
    restore_rng_state,
    single_process_is_intended,
    world_size,
)
from storage.checkpoints.record import (
    COMMITTED,
    LEARNER_STATE,
    CommittedRecord,
    FileCheck,
    stored_sizes,
)
from storage.checkpoints.writer import HashingWriter, gather_written, stored_as_written
from storage.fs import Location, StorageError, put_if_absent

if TYPE_CHECKING:
    from storage.control.fencing import Fence

__all__ = ["COMMITTED", "CheckpointStore", "LearnerState", "ModelState", "step_dirname"]

log = logging.getLogger(__name__)

_STATE_FORMAT = 1  # of learner_state.json
_STEP_DIR = re.compile(r"step-(\d{8})")


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
    """A model and (optionally) its optimiser as one DCP entry, FSDP2-aware. `keep`: which of
    the model's state-dict names are saved (default all; with it, `options.strict` must be
    False so that loading leaves the others as they are)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        options: StateDictOptions | None = None,
        keep: Callable[[str], bool] | None = None,
    ) -> None:
        self.model, self.optimizer, self.options, self.keep = model, optimizer, options, keep

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {"model": self._kept(get_model_state_dict(self.model, options=self.options))}
        model, optim = get_state_dict(self.model, self.optimizer, options=self.options)
        return {"model": self._kept(model), "optim": optim}

    def _kept(self, model_state: dict[str, Any]) -> dict[str, Any]:
        if self.keep is None:
            return model_state
        return {name: value for name, value in model_state.items() if self.keep(name)}

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
    """The checkpoints of one run, under `<run>/checkpoints/`.

    `fence`: the writer's lease; `fence.check()` (the epoch held, or it raises) is called
    right before COMMITTED is written and before each checkpoint folder is deleted.
    `damaged`: the steps `latest_verified` passed over because they failed their checks; a
    later `save` of such a step replaces it (a learner resumed before it reaches it again)."""

    def __init__(self, run: Location, fence: Fence | None = None) -> None:
        self.location = run.child("checkpoints")
        self.fence = fence
        self.damaged: list[int] = []
        self._verified: set[int] = set()  # steps whose every file passed, in this process

    def save(self, app_state: dict[str, Any], state: LearnerState) -> None:
        """Save `app_state` (name → `Stateful` or state dict) as checkpoint `state.step`.

        Raises `StorageError` if that step is already committed; whatever `fence.check()`
        raises, with nothing committed.
        """
        folder = self.location.child(step_dirname(state.step))
        per_rank = all_gather({"learner": asdict(state), "rng": capture_rng_state()})
        on_rank0(lambda: self._prepare(folder, state, [got["learner"] for got in per_rank]))
        writer = HashingWriter(folder.uri, sync_files=folder.is_local, **folder.storage_options())
        with single_process_is_intended():
            dcp.save(app_state, storage_writer=writer)
        written = gather_written(writer)  # every rank's files, hashed as they were written
        rng = [got["rng"] for got in per_rank]
        on_rank0(lambda: self._commit(folder, self._record(folder, state, rng, written)))

    def load(
        self, step: int, app_state: dict[str, Any], *, restore_rng: bool = True
    ) -> LearnerState:
        """Load committed checkpoint `step` into `app_state` in place; restore RNG states.

        Raises `StorageError` if `step` is not committed (naming those that are), if the
        checkpoint is damaged (a file's size or xxh3 differs from COMMITTED), or if
        `restore_rng` and the world size differs from the saved one.
        """
        folder = self.location.child(step_dirname(step))
        body = self._verify(step)
        world = world_size()
        if restore_rng and body["world_size"] != world:
            raise StorageError(
                f"checkpoint {folder.uri} was saved by {body['world_size']} ranks, this job has "
                f"{world}; RNG states are per rank. Resume with the same world size or load "
                "with restore_rng=False"
            )
        reader = FsspecReader(folder.uri, **folder.storage_options())
        with single_process_is_intended():
            dcp.load(app_state, storage_reader=reader)
        if restore_rng:
            restore_rng_state(body["rng"][rank()])
        return LearnerState(**body["learner"])

    def read_state(self, step: int) -> LearnerState:
        """The learner state of committed checkpoint `step`, checked against COMMITTED,
        without reading any shard: check it before `load` (a collective, like `load`)."""
        folder = self.location.child(step_dirname(step))
        body = on_rank0(lambda: self._committed_state(folder, step)[1])
        return LearnerState(**body["learner"])

    def committed_steps(self) -> list[int]:
        """Steps with a committed checkpoint, oldest first (unchecked: see `latest_verified`)."""
        return on_rank0(lambda: sorted(s for s, done in self._scan().items() if done))

    def latest_committed(self) -> int | None:
        """The newest committed step, or None when there is none. Reads no shard: to resume,
        use `latest_verified`."""
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def latest_verified(self) -> int | None:
        """The newest committed step whose every file passes its size and xxh3 check (the one
        to resume from), or None. A checkpoint that fails is logged as an error, added to
        `damaged` and passed over for the previous one; a storage error that proves nothing
        (unreachable, timeout) is raised instead."""
        passed_over = []
        for step in reversed(self.committed_steps()):
            try:
                self._verify(step)
            except StorageError as exc:
                self.damaged.append(step)
                passed_over.append(step)
                log.error("passing over checkpoint step %d: %s", step, exc)
                continue
            if passed_over:
                log.warning(
                    "resuming from checkpoint step %d of %s: the newer steps %s are damaged",
                    step, self.location.uri, passed_over,
                )  # fmt: skip
            return step
        return None

    def retain(self, keep: int) -> list[int]:
        """Keep the newest `keep` committed checkpoints; delete older ones and uncommitted
        folders older than the newest committed one. Returns the deleted steps."""
        if keep < 1:
            raise ValueError(f"keep must be ≥ 1 (got {keep}); the newest checkpoint is kept")
        return on_rank0(lambda: self._retain(keep))

    def _verify(self, step: int) -> dict[str, Any]:
        """The learner state body of `step` once every file passed its check (a collective;
        each rank hashes its share). Raises `StorageError` when the checkpoint is damaged."""
        folder = self.location.child(step_dirname(step))
        record, body = on_rank0(lambda: self._committed_state(folder, step))
        if step in self._verified:
            return body
        if record.checksummed:
            hashes = hash_share(folder, sorted(record.files))
            failed = sorted(n for n, check in record.files.items() if hashes[n] != check.xxh3)
            if failed:
                raise StorageError(
                    f"checkpoint {folder.uri} is damaged: {', '.join(failed)} fails its xxh3 "
                    "check; resume from an earlier checkpoint (latest_verified())"
                )
        else:
            log.info("checkpoint %s was committed before checksums: checked sizes only", folder.uri)
        self._verified.add(step)
        return body

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
        committed = fs.exists(folder.join(COMMITTED))
        if committed and state.step not in self.damaged:
            raise StorageError(
                f"checkpoint {folder.uri} is already committed; checkpoints are never "
                f"overwritten (resume from it, or delete it to take step {state.step} again)"
            )
        if committed:  # passed over as damaged when this learner resumed before it
            log.warning("replacing damaged checkpoint %s with a new save", folder.uri)
            self._check_fence()
            fs.rm_file(folder.join(COMMITTED))
        if fs.exists(folder.path):  # left by a save that died: start from an empty folder
            self._check_fence()
            fs.rm(folder.path, recursive=True)

    def _record(
        self,
        folder: Location,
        state: LearnerState,
        rng: list[dict[str, Any]],
        written: dict[str, FileCheck],
    ) -> CommittedRecord:
        """Write learner_state.json; the record of it and of the `written` DCP files, once a
        listing shows exactly those files at those sizes."""
        body = {
            "format": _STATE_FORMAT,
            "world_size": len(rng),
            "learner": asdict(state),
            "rng": rng,
        }
        data = json.dumps(body, sort_keys=True).encode()
        folder.fs.pipe_file(folder.join(LEARNER_STATE), data)
        files = {**written, LEARNER_STATE: FileCheck.of(data)}
        stored_as_written(folder, files)
        return CommittedRecord(state.step, len(rng), files)

    def _commit(self, folder: Location, record: CommittedRecord) -> None:
        if self.fence is not None:
            record = replace(record, epoch=self.fence.check())
        data = record.to_json()
        created = put_if_absent(folder.fs, folder.join(COMMITTED), data)
        if not created and folder.fs.cat_file(folder.join(COMMITTED)) != data:  # not a retry
            raise StorageError(f"{folder.uri} was committed by another writer meanwhile")

    def _committed_state(
        self, folder: Location, step: int
    ) -> tuple[CommittedRecord, dict[str, Any]]:
        """COMMITTED and the learner state it commits, with every listed file present at its
        size. Raises `StorageError` naming what is missing or damaged."""
        fs = folder.fs
        try:
            data = fs.cat_file(folder.join(COMMITTED))
        except FileNotFoundError:
            committed = sorted(s for s, done in self._scan().items() if done)
            raise StorageError(
                f"no committed checkpoint for step {step} at {self.location.uri} "
                f"({folder.join(COMMITTED)} not found); committed steps: "
                f"{committed or 'none'}. Resume from one of them (latest_verified())"
            ) from None
        record = CommittedRecord.from_json(data, folder.uri)
        present = stored_sizes(folder)
        for name, check in record.files.items():
            if present.get(name) != check.size:
                raise StorageError(
                    f"checkpoint {folder.uri} is damaged: {name} has "
                    f"{present.get(name, 'no')} bytes, COMMITTED says {check.size}; resume from "
                    "an earlier checkpoint"
                )
        learner_bytes = fs.cat_file(folder.join(LEARNER_STATE))
        record.check_learner_state(learner_bytes, folder.uri)
        return record, json.loads(learner_bytes)

    def _retain(self, keep: int) -> list[int]:
        steps = self._scan()
        committed = sorted(s for s, done in steps.items() if done)
        doomed = set(committed[:-keep])
        if committed:
            doomed |= {s for s, done in steps.items() if not done and s < committed[-1]}
        fs = self.location.fs
        for step in sorted(doomed):
            folder = self.location.child(step_dirname(step))
            self._check_fence()
            if steps[step]:  # uncommit first: a crash mid-delete leaves only garbage
                fs.rm_file(folder.join(COMMITTED))
            fs.rm(folder.path, recursive=True)
        return sorted(doomed)

    def _check_fence(self) -> None:
        if self.fence is not None:
            self.fence.check()
