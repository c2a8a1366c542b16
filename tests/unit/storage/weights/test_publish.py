"""Writing weight versions on a local folder and on SeaweedFS: files and pieces, a publisher
killed by SIGKILL before its manifest, the fence, immutable versions, bad input and delta
versions (a publish sharded over learner ranks: test_weight_sharding.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
import safetensors.torch
import torch

from storage.fs import Location, open_location
from storage.weights.publish import WeightVersionExistsError, WeightWriter
from storage.weights.shares import NonFiniteWeightsError, whole_shares
from storage.weights.versions import WeightIntegrityError, WeightStore, WeightVersionNotFoundError
from tests.unit.storage.weights.test_versions import (
    REPO_ROOT,
    _assert_exact,
    _folder,
    _path,
    _state_dict,
)


def test_small_shard_bytes_gives_many_files_each_piece_once(run_location):
    writer, store = WeightWriter(run_location), WeightStore(run_location)
    state = _state_dict()
    manifest = writer.publish(3, state, shard_bytes=4096)  # embed (8 KiB) exceeds it: alone

    groups = {}
    for name, entry in manifest.tensors.items():
        for piece in entry.pieces:
            groups.setdefault(piece.file, []).append(name)
    assert [groups[f.file] for f in manifest.files] == [
        ["embed.weight"],  # 8192 bytes
        ["layers.0.mlp.weight", "layers.0.mlp.bias"],  # 3168 + 96; + 1024 would exceed 4096
        ["position_ids", "scale", "head.bias", "transposed"],
    ]
    for file in manifest.files:
        stored = safetensors.torch.load(run_location.fs.cat_file(_path(run_location, 3, file.file)))
        assert sorted(stored) == sorted(f"{name}@0" for name in groups[file.file])
    _assert_exact(store.load(3)[0], state)


_KILLED_PUBLISHER = """
import json, sys, time, torch
from storage.fs import open_location
from storage.weights.shares import whole_shares
from storage.weights.publish import WeightWriter
uri, options = json.loads(sys.stdin.readline())
writer = WeightWriter(open_location(uri, storage_options=options))
state = {f"layers.{i}.weight": torch.randn(256, 1024) for i in range(4)}
part = writer.write_share(2, whole_shares(state), publish_id="killed", rank=0, world=1,
                          shard_bytes=1024**2)
print(json.dumps([file.file for file in part.files]), flush=True)
time.sleep(300)
writer.commit(2, publish_id="killed", world=1)
"""


def test_publisher_killed_before_manifest_is_invisible(run_uri_and_options, tmp_path):
    uri, options = run_uri_and_options
    location = open_location(uri, storage_options=options)
    writer, store = WeightWriter(location), WeightStore(location)
    writer.publish(1, _state_dict(1))

    with open(tmp_path / "stderr.txt", "wb") as stderr:
        publisher = subprocess.Popen(
            [sys.executable, "-c", _KILLED_PUBLISHER],
            cwd=REPO_ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    try:
        publisher.stdin.write(json.dumps([uri, options]) + "\n")  # keys never on argv
        publisher.stdin.close()
        line = publisher.stdout.readline()
        assert line, (tmp_path / "stderr.txt").read_text()
        files = json.loads(line)
        assert len(files) == 4
        assert all(location.fs.exists(_path(location, 2, f)) for f in files)
    finally:
        publisher.send_signal(signal.SIGKILL)
        publisher.wait(timeout=30)
    assert publisher.returncode == -signal.SIGKILL

    assert store.versions() == [1]
    assert store.latest_version() == 1
    with pytest.raises(WeightVersionNotFoundError, match=r"available versions: \[1\]"):
        store.load(2)
    assert writer.retain(keep=5) == []  # v2 is newer than every manifest: may be in progress
    assert location.fs.exists(_path(location, 2, files[0]))

    writer.publish(3, _state_dict(3))
    assert (store.versions(), store.latest_version()) == ([1, 3], 3)
    assert writer.retain(keep=5) == [2]  # now a dead publish
    assert not any(location.fs.exists(_path(location, 2, f)) for f in files)
    assert writer.retain(keep=5) == []
    assert store.versions() == [1, 3]
    _assert_exact(store.load(1)[0], _state_dict(1))


class _LeaseLostError(RuntimeError):
    pass


class _Fence:
    """A writer's lease that holds `epoch` for `checks` more checks, then is lost."""

    def __init__(self, epoch: int, checks: int = 1_000) -> None:
        self.epoch, self.left, self.checks = epoch, checks, 0

    def check(self) -> int:
        self.checks += 1
        if self.checks > self.left:
            raise _LeaseLostError(f"epoch {self.epoch} lost")
        return self.epoch


def _latest(location: Location) -> int:
    return json.loads(location.fs.cat_file(location.join("weights", "LATEST")))["version"]


def test_the_fence_guards_manifest_latest_and_retention(run_location):
    fence = _Fence(epoch=7)
    writer, store = WeightWriter(run_location, fence=fence), WeightStore(run_location)
    assert writer.publish(1, _state_dict(1)).epoch == 7
    assert fence.checks == 2  # before the manifest, before LATEST
    assert store.read_manifest(1).epoch == 7
    assert WeightWriter(run_location).publish(2, _state_dict(2)).epoch is None  # no lease
    raw = json.loads(run_location.fs.cat_file(_path(run_location, 2, "manifest.json")))
    assert "epoch" not in raw  # what a release before leases wrote, and still reads
    assert store.read_manifest(2).epoch is None

    lost = WeightWriter(run_location, fence=_Fence(epoch=7, checks=0))
    lost.write_share(3, whole_shares(_state_dict(3)), publish_id="p", rank=0, world=1)
    with pytest.raises(_LeaseLostError):
        lost.commit(3, publish_id="p", world=1)
    assert not run_location.fs.exists(_path(run_location, 3, "manifest.json"))
    assert (store.versions(), _latest(run_location)) == ([1, 2], 2)

    lost_after_manifest = WeightWriter(run_location, fence=_Fence(epoch=8, checks=1))
    with pytest.raises(_LeaseLostError):
        lost_after_manifest.commit(3, publish_id="p", world=1)
    assert store.read_manifest(3).epoch == 8  # committed, but LATEST did not move
    assert (store.versions(), _latest(run_location)) == ([1, 2, 3], 2)
    with pytest.raises(_LeaseLostError):  # a retry by a learner that lost its lease moves nothing
        WeightWriter(run_location, fence=_Fence(epoch=8, checks=0)).commit(
            3, publish_id="p", world=1
        )
    assert _latest(run_location) == 2

    # retain(keep=1) deletes v1 (LATEST names v2) and v3's part record, each after a check.
    before = {v: _folder(run_location, v) for v in (1, 2, 3)}
    assert "p-part-00000-of-00001.json" in before[3]
    with pytest.raises(_LeaseLostError):
        WeightWriter(run_location, fence=_Fence(epoch=9, checks=0)).retain(keep=1)
    assert {v: _folder(run_location, v) for v in (1, 2, 3)} == before
    with pytest.raises(_LeaseLostError):  # lost after v1 went
        WeightWriter(run_location, fence=_Fence(epoch=9, checks=1)).retain(keep=1)
    assert store.versions() == [2, 3]
    assert {v: _folder(run_location, v) for v in (2, 3)} == {v: before[v] for v in (2, 3)}
    assert writer.retain(keep=1) == []
    assert "p-part-00000-of-00001.json" not in _folder(run_location, 3)
    assert writer.commit(3, publish_id="p", world=1).epoch == 8  # the retry that moves LATEST
    assert _latest(run_location) == 3


def test_versions_are_immutable(run_location):
    writer, store = WeightWriter(run_location), WeightStore(run_location)
    writer.publish(1, _state_dict(1))
    with pytest.raises(WeightVersionExistsError, match="version 1 is already committed"):
        writer.publish(1, _state_dict(2))
    writer.write_share(2, whole_shares(_state_dict(2)), publish_id="p", rank=0, world=1)
    manifest = writer.commit(2, publish_id="p", world=1)
    assert writer.commit(2, publish_id="p", world=1) == manifest  # a retry: nothing changes
    with pytest.raises(WeightVersionExistsError, match="publish a version > 2"):
        writer.commit(2, publish_id="q", world=1)
    with pytest.raises(WeightVersionExistsError, match="version 2 is already committed"):
        writer.write_share(2, whole_shares(_state_dict(3)), publish_id="q", rank=0, world=1)
    _assert_exact(store.load(1)[0], _state_dict(1))  # untouched
    _assert_exact(store.load(2)[0], _state_dict(2))


def test_commit_refuses_missing_files(tmp_path):
    location = open_location(str(tmp_path / "run"))
    writer, store = WeightWriter(location), WeightStore(location)
    part = writer.write_share(
        1, whole_shares(_state_dict()), publish_id="p", rank=0, world=1, shard_bytes=4096
    )
    location.fs.rm_file(_path(location, 1, part.files[1].file))
    with pytest.raises(WeightIntegrityError, match=f"{part.files[1].file} is missing"):
        writer.commit(1, publish_id="p", world=1)
    assert store.versions() == []
    assert store.latest_version() is None


@pytest.mark.parametrize("version", [0, -1, 1.5, True, "3"])
def test_bad_versions_are_refused(tmp_path, version):
    writer = WeightWriter(open_location(str(tmp_path / "run")))
    with pytest.raises(ValueError, match="weight version must be an int >= 1"):
        writer.publish(version, {"w": torch.ones(1)})
    assert writer.reader.versions() == []


def test_bad_state_dicts_and_configs_are_refused(tmp_path):
    writer = WeightWriter(open_location(str(tmp_path / "run")))
    with pytest.raises(TypeError, match=r"state_dict\['b'\] is a list, not a Tensor"):
        writer.publish(1, {"a": torch.ones(1), "b": [1.0]})
    with pytest.raises(ValueError, match="state_dict is empty"):
        writer.publish(1, {})
    with pytest.raises(ValueError, match="shard_bytes must be an int >= 1"):
        writer.publish(1, {"a": torch.ones(1)}, shard_bytes=0)
    with pytest.raises(TypeError, match="model_config must be JSON-serialisable"):
        writer.publish(1, {"a": torch.ones(1)}, model_config={"dtype": torch.float32})
    with pytest.raises(ValueError, match="base version 1 must be in"):
        writer.publish(1, {"a": torch.ones(1)}, base=(1, {"a": torch.ones(1)}))
    with pytest.raises(ValueError, match="base piece of 'a' differs in shape"):
        writer.publish(2, {"a": torch.ones(1)}, base=(1, {"a": torch.ones(2)}))
    assert writer.reader.versions() == []
    assert not writer.fs.exists(writer.root.path)


def test_non_finite_weights_are_refused_before_anything_is_written(run_location):
    """A NaN/inf tensor (a diverged learner) is never published: clear error naming it,
    no object of the version written, LATEST still on the previous version."""
    writer, store = WeightWriter(run_location), WeightStore(run_location)
    writer.publish(1, _state_dict(0))
    for bad in (float("nan"), float("inf"), -float("inf")):
        state = _state_dict(1)
        state["layers.0.mlp.bias"][3] = bad
        with pytest.raises(NonFiniteWeightsError, match=r"v2: 1 tensor\(s\) hold NaN or inf"):
            writer.publish(2, state, base=(1, _state_dict(0)))
        with pytest.raises(NonFiniteWeightsError, match=r"layers\.0\.mlp\.bias"):
            writer.write_share(2, whole_shares(state), publish_id="p", rank=0, world=1)
    assert store.versions() == [1]
    assert store.latest_version() == 1
    assert not run_location.fs.exists(run_location.join("weights", "v00000002"))
    _assert_exact(store.load()[0], _state_dict(0))


# -- deltas ---------------------------------------------------------------------------------


def test_delta_version_is_bit_exact_and_stores_only_the_changed_elements(run_location):
    writer, store = WeightWriter(run_location), WeightStore(run_location)
    old = _state_dict(0)
    old["embed.weight"][0, 0] = 0.0
    new = {name: tensor.clone() for name, tensor in old.items()}
    new["embed.weight"][0, 0] = -0.0  # equal as a value, not as bits
    new["embed.weight"][9, 31] += 1.0
    new["layers.0.mlp.bias"][47] = 2.0
    first = writer.publish(1, old)
    # Tiny files: a delta's positions and values still share one file.
    manifest = writer.publish(2, new, base=(1, old), shard_bytes=1)

    assert manifest.base == 1
    assert {p.encoding for e in manifest.tensors.values() for p in e.pieces} == {"delta"}
    files = {
        file.file: safetensors.torch.load(
            run_location.fs.cat_file(_path(run_location, 2, file.file))
        )
        for file in manifest.files
    }
    assert len(files) > 1
    for name, entry in manifest.tensors.items():
        for piece in entry.pieces:  # both entries of a delta piece in the file it names
            assert {f"{name}@0.index", f"{name}@0.values"} <= set(files[piece.file]), name
    stored = {key: t for entries in files.values() for key, t in entries.items()}
    assert stored["embed.weight@0.index"].tolist() == [0, 9 * 32 + 31]
    assert stored["layers.0.mlp.bias@0.index"].tolist() == [47]
    payload = sum(t.numel() * t.element_size() for t in stored.values())
    assert payload == 2 * (4 + 4) + 1 * (4 + 2)
    assert manifest.stored_bytes < first.stored_bytes / 2

    tensors, _ = store.load(2)
    _assert_exact(tensors, new)
    assert torch.signbit(tensors["embed.weight"][0, 0])
    assert [m.version for m in store.chain(2)] == [1, 2]


def test_a_delta_larger_than_max_delta_ratio_is_stored_full(run_location):
    writer, store = WeightWriter(run_location), WeightStore(run_location)
    old, new = _state_dict(0), _state_dict(1)  # nearly every element differs
    writer.publish(1, old)
    manifest = writer.publish(2, new, base=(1, old), max_delta_ratio=0.5)
    assert manifest.base is None
    assert {p.encoding for e in manifest.tensors.values() for p in e.pieces} == {"full"}
    assert [m.version for m in store.chain(2)] == [2]
    _assert_exact(store.load(2)[0], new)
