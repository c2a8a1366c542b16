"""DCP checkpoints: single-process round trips on both backends, commit/retention rules, the
size and xxh3 of every file recorded as stored without reading anything back, and checked on
resume (a damaged checkpoint is passed over for the previous one; checkpoints committed before
checksums still load), the writer's fence, and a two-rank FSDP2 job on SeaweedFS that resumes
in a fresh job with bit-identical losses."""

from __future__ import annotations

import hashlib
import json
import logging
import random
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from fsspec.implementations.local import LocalFileSystem
from s3fs import S3FileSystem
from torch import nn

from storage.checkpoints.dcp import (
    COMMITTED,
    CheckpointStore,
    LearnerState,
    ModelState,
    step_dirname,
)
from storage.fs import Location, StorageError
from storage.seaweedfs import SeaweedFS
from tests.integration.torchrun import torchrun

WORKER = Path(__file__).with_name("fsdp_worker.py")


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, nn.Module]:
    """A small policy with AdamW after two updates, and a value model without an optimiser."""
    torch.manual_seed(seed)
    policy, value = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)), nn.Linear(6, 1)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=0.1)
    for _ in range(2):
        policy(torch.randn(4, 6)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return policy, optimizer, value


def _app_state(seed: int) -> dict[str, ModelState]:
    policy, optimizer, value = _trained(seed)
    return {"policy": ModelState(policy, optimizer), "value": ModelState(value)}


def _draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), torch.rand(1).item()


def _save(store: CheckpointStore, step: int) -> None:
    store.save(_app_state(step), LearnerState(step=step, policy_version=step))


def _leave_uncommitted(store: CheckpointStore, step: int) -> None:
    """What a learner that died mid-save leaves: shards but no COMMITTED."""
    folder = store.location.child(step_dirname(step))
    folder.fs.makedirs(folder.path, exist_ok=True)
    folder.fs.pipe_file(folder.join("__0_0.distcp"), b"half a shard")


def test_round_trip_restores_model_optimizer_and_rng(run_location: Location) -> None:
    store = CheckpointStore(run_location)
    saved = _app_state(seed=1)
    state = LearnerState(
        step=7, policy_version=3, stream_cursor={"next_seq": 42, "open": [1, 2]}, extra={"a": 1}
    )
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    store.save(saved, state)
    expected = _draws()

    fresh = _app_state(seed=2)  # different weights, optimiser moments and RNG
    loaded = store.load(7, fresh)
    assert loaded == state
    assert _draws() == expected
    for name in ("policy", "value"):
        want, got = saved[name].state_dict(), fresh[name].state_dict()
        for key, tensor in want["model"].items():
            assert torch.equal(got["model"][key], tensor), key
    want_optim = saved["policy"].state_dict()["optim"]["state"]
    got_optim = fresh["policy"].state_dict()["optim"]["state"]
    assert want_optim.keys() == got_optim.keys()
    for key, moments in want_optim.items():
        for moment, tensor in moments.items():
            assert torch.equal(got_optim[key][moment], tensor), (key, moment)


def test_latest_committed_ignores_uncommitted_folders(run_location: Location) -> None:
    store = CheckpointStore(run_location)
    assert store.latest_committed() is None
    _save(store, 1)
    _save(store, 2)
    _leave_uncommitted(store, 3)
    assert store.committed_steps() == [1, 2]
    assert store.latest_committed() == 2


def test_load_of_uncommitted_step_names_committed_ones(run_location: Location) -> None:
    store = CheckpointStore(run_location)
    _save(store, 2)
    _save(store, 4)
    _leave_uncommitted(store, 6)
    with pytest.raises(StorageError, match=r"no committed checkpoint for step 6.*\[2, 4\]"):
        store.load(6, _app_state(seed=0))
    with pytest.raises(StorageError, match=r"step 9.*\[2, 4\]"):
        store.load(9, _app_state(seed=0))


def test_retain_keeps_newest_committed(run_location: Location) -> None:
    store = CheckpointStore(run_location)
    for step in (1, 2, 4, 5):
        _save(store, step)
    _leave_uncommitted(store, 3)  # older than the newest committed: garbage
    _leave_uncommitted(store, 6)  # newer: perhaps being written now, kept
    assert store.retain(keep=2) == [1, 2, 3]
    assert store.committed_steps() == [4, 5]
    objects = store.location.fs.find(store.location.path)
    assert sorted({Path(p).parent.name for p in objects}) == [
        step_dirname(4),
        step_dirname(5),
        step_dirname(6),
    ]
    assert store.retain(keep=2) == []


def test_committed_checkpoint_is_never_overwritten(run_location: Location) -> None:
    store = CheckpointStore(run_location)
    _save(store, 3)
    with pytest.raises(StorageError, match="already committed"):
        _save(store, 3)


def test_save_replaces_a_dead_save_of_the_same_step(run_location: Location) -> None:
    store = CheckpointStore(run_location)
    folder = store.location.child(step_dirname(3))
    _leave_uncommitted(store, 3)
    folder.fs.pipe_file(folder.join("__5_0.distcp"), b"from a larger world")
    _save(store, 3)
    record = json.loads(folder.fs.cat_file(folder.join(COMMITTED)))
    assert "__5_0.distcp" not in record["files"]
    assert not folder.fs.exists(folder.join("__5_0.distcp"))
    assert store.load(3, _app_state(seed=0)).step == 3


def test_damaged_checkpoint_is_refused(run_location: Location) -> None:
    store = CheckpointStore(run_location)
    _save(store, 1)
    folder = store.location.child(step_dirname(1))
    folder.fs.pipe_file(folder.join("__0_0.distcp"), b"truncated")
    with pytest.raises(StorageError, match=r"damaged: __0_0\.distcp has 9 bytes"):
        store.load(1, _app_state(seed=0))


def _flip_byte(folder: Location, name: str) -> None:
    data = bytearray(folder.fs.cat_file(folder.join(name)))
    data[len(data) // 2] ^= 0x01
    folder.fs.pipe_file(folder.join(name), bytes(data))


def _assert_same_tensors(want: dict[str, ModelState], got: dict[str, ModelState]) -> None:
    for name in want:
        for key, tensor in want[name].state_dict()["model"].items():
            assert torch.equal(got[name].state_dict()["model"][key], tensor), (name, key)


def test_a_flipped_byte_is_reported_and_the_previous_checkpoint_loads_exactly(
    run_location: Location, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(run_location)
    first = _app_state(seed=1)
    store.save(first, LearnerState(step=1, policy_version=1, stream_cursor={"seq": 4}))
    expected_draws = _draws()
    _save(store, 2)
    damaged = store.location.child(step_dirname(2))
    _flip_byte(damaged, "__0_0.distcp")

    resumed = CheckpointStore(run_location)  # a fresh learner's view
    with pytest.raises(StorageError, match=r"step-00000002.*__0_0\.distcp fails its xxh3 check"):
        resumed.load(2, _app_state(seed=0))
    with caplog.at_level(logging.WARNING, logger="storage.checkpoints.dcp"):
        assert resumed.latest_verified() == 1
    assert resumed.damaged == [2]
    assert "__0_0.distcp fails its xxh3 check" in caplog.text
    assert "step 1" in caplog.text
    assert resumed.committed_steps() == [1, 2]  # reported, not deleted

    fresh = _app_state(seed=3)
    state = resumed.load(1, fresh)
    assert state == LearnerState(step=1, policy_version=1, stream_cursor={"seq": 4})
    assert _draws() == expected_draws
    _assert_same_tensors(first, fresh)
    _save(resumed, 2)  # training on from step 1 takes step 2 again: the damaged one is replaced
    assert CheckpointStore(run_location).latest_verified() == 2


def test_every_file_is_recorded_with_the_size_and_xxh3_of_its_stored_bytes(
    run_location: Location,
) -> None:
    store = CheckpointStore(run_location)
    _save(store, 1)
    folder = store.location.child(step_dirname(1))
    record = json.loads(folder.fs.cat_file(folder.join(COMMITTED)))
    stored = {p.rsplit("/", 1)[-1] for p in folder.fs.find(folder.path)} - {COMMITTED}
    assert set(record["files"]) == stored >= {".metadata", "__0_0.distcp", "learner_state.json"}
    for name, entry in record["files"].items():
        data = folder.fs.cat_file(folder.join(name))
        assert entry == {"size": len(data), "xxh3": xxhash.xxh3_128_hexdigest(data)}, name
    assert "epoch" not in record  # no fence


def test_a_save_reads_nothing_back_and_a_resume_reads_every_file(
    run_location: Location, monkeypatch: pytest.MonkeyPatch
) -> None:
    """COMMITTED is written from the bytes as DCP wrote them; verifying on resume reads them."""
    reads: list[str] = []  # every object or file of this run read, locally or from S3
    local_open, call_s3 = LocalFileSystem._open, S3FileSystem._call_s3

    def note(path: str) -> None:  # other runs of this process (other tests) are not counted
        if path.startswith(run_location.path.rstrip("/") + "/"):
            reads.append(path)

    def spy_open(fs: LocalFileSystem, path: str, mode: str = "rb", **kwargs) -> object:
        if "r" in mode:
            note(path)
        return local_open(fs, path, mode, **kwargs)

    async def spy_call_s3(fs: S3FileSystem, method: str, *args, **kwargs) -> object:
        if method == "get_object":
            note(f"{kwargs['Bucket']}/{kwargs['Key']}")
        return await call_s3(fs, method, *args, **kwargs)

    monkeypatch.setattr(LocalFileSystem, "_open", spy_open)
    monkeypatch.setattr(S3FileSystem, "_call_s3", spy_call_s3)
    _save(CheckpointStore(run_location), 1)
    assert reads == []
    assert CheckpointStore(run_location).latest_verified() == 1
    read_names = {path.rsplit("/", 1)[-1] for path in reads}
    assert read_names >= {"__0_0.distcp", ".metadata", "learner_state.json", COMMITTED}


def test_a_checkpoint_committed_before_checksums_still_loads_checking_sizes(
    run_location: Location, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(run_location)
    saved = _app_state(seed=1)
    store.save(saved, LearnerState(step=1, policy_version=1))
    folder = store.location.child(step_dirname(1))
    record = json.loads(folder.fs.cat_file(folder.join(COMMITTED)))
    learner_bytes = folder.fs.cat_file(folder.join("learner_state.json"))
    old = {  # the COMMITTED of format 1: sizes and the learner state's sha256
        "format": 1,
        "step": 1,
        "world_size": 1,
        "learner_state_sha256": hashlib.sha256(learner_bytes).hexdigest(),
        "files": {name: entry["size"] for name, entry in record["files"].items()},
    }
    folder.fs.pipe_file(folder.join(COMMITTED), json.dumps(old).encode())

    resumed, fresh = CheckpointStore(run_location), _app_state(seed=2)
    with caplog.at_level(logging.INFO, logger="storage.checkpoints.dcp"):
        assert resumed.latest_verified() == 1
        assert resumed.load(1, fresh).step == 1
    assert "sizes only" in caplog.text
    _assert_same_tensors(saved, fresh)


def test_a_committed_record_naming_a_path_outside_its_folder_is_damaged(
    run_location: Location,
) -> None:
    store = CheckpointStore(run_location)
    _save(store, 1)
    _save(store, 2)
    folder = store.location.child(step_dirname(2))
    record = json.loads(folder.fs.cat_file(folder.join(COMMITTED)))
    record["files"]["../../stream/log/000000000000.json"] = {"size": 1, "xxh3": "0" * 32}
    folder.fs.pipe_file(folder.join(COMMITTED), json.dumps(record).encode())
    assert CheckpointStore(run_location).latest_verified() == 1
    with pytest.raises(StorageError, match="not a file name of the checkpoint"):
        CheckpointStore(run_location).read_state(2)


class _Fence:
    """A writer's lease as the store sees it: `check` returns the epoch held, or raises."""

    def __init__(self, epoch: int) -> None:
        self.epoch, self.lost, self.checks = epoch, False, 0

    def check(self) -> int:
        self.checks += 1
        if self.lost:
            raise RuntimeError(f"lease lost: epoch {self.epoch + 1} exists")
        return self.epoch


def test_the_fence_is_checked_before_commit_and_deletion_and_its_epoch_recorded(
    run_location: Location,
) -> None:
    fence = _Fence(epoch=7)
    store = CheckpointStore(run_location, fence=fence)
    _save(store, 1)
    folder = store.location.child(step_dirname(1))
    assert json.loads(folder.fs.cat_file(folder.join(COMMITTED)))["epoch"] == 7
    assert fence.checks >= 1
    _save(store, 2)

    fence.lost = True
    with pytest.raises(RuntimeError, match="lease lost"):
        _save(store, 3)
    assert store.committed_steps() == [1, 2]  # step 3 was never committed
    with pytest.raises(RuntimeError, match="lease lost"):
        store.retain(keep=1)
    assert store.committed_steps() == [1, 2]  # nothing deleted
    fence.lost = False
    assert store.retain(keep=1) == [1]  # step 3, newer than any committed, may be in progress


def _torchrun(phase: str, uri: str, out: Path, env: dict[str, str]) -> None:
    torchrun(WORKER, f"--phase={phase}", f"--uri={uri}", "--steps=3", f"--out={out}", env=env)


def test_fsdp2_two_ranks_resume_bit_identical(seaweedfs: SeaweedFS, tmp_path: Path) -> None:
    """Job 1 trains 3 steps on 2 gloo ranks, checkpoints to S3, runs steps 3 and 4; a fresh
    job 2 loads the checkpoint and runs steps 3 and 4: every loss on every rank is equal."""
    uri = f"s3://{seaweedfs.bucket}/runs/{uuid.uuid4().hex[:12]}"
    env = {**seaweedfs.env, "MASTER_ADDR": "127.0.0.1"}
    _torchrun("save", uri, tmp_path, env)
    _torchrun("resume", uri, tmp_path, env)
    for rank in (0, 1):
        saved = json.loads((tmp_path / f"save-rank{rank}.json").read_text())
        resumed = json.loads((tmp_path / f"resume-rank{rank}.json").read_text())
        # [[policy, value] loss of step 3, [policy, value] loss of step 4]: exact, not close.
        assert resumed["following"] == saved["following"], rank
        assert resumed["learner"] == saved["learner"]
        assert resumed["learner"]["stream_cursor"] == {"next_seq": 9, "epoch": 0}
        assert "differs between ranks (rank 0 vs ranks [1])" in resumed["mismatch_error"]
    ranks = [json.loads((tmp_path / f"save-rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["following"] != ranks[1]["following"]  # each rank had its own data and RNG
