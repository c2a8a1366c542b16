"""DCP checkpoints: single-process round trips on both backends, commit/retention rules, and a
two-rank FSDP2 job on SeaweedFS that resumes in a fresh job with bit-identical losses."""

from __future__ import annotations

import json
import random
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from storage.checkpoints import (
    COMMITTED,
    CheckpointStore,
    LearnerState,
    ModelState,
    step_dirname,
)
from storage.fs import Location, StorageError
from storage.seaweedfs import SeaweedFS
from tests.integration.torchrun import torchrun

WORKER = Path(__file__).with_name("fsdp_checkpoint_worker.py")


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
