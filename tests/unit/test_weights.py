"""Weight store on a local folder and on SeaweedFS: round trips, sharding, LATEST, a publisher
killed by SIGKILL before its manifest, tampered shards, retention and bad input."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
import torch

from storage.fs import Location, open_location
from storage.weights import (
    NonFiniteWeightsError,
    WeightIntegrityError,
    WeightManifest,
    WeightStore,
    WeightVersionExistsError,
    WeightVersionNotFoundError,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def _state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 32, generator=g),
        "layers.0.mlp.weight": torch.randn(32, 48, generator=g).to(torch.bfloat16),
        "layers.0.mlp.bias": torch.randn(48, generator=g).to(torch.bfloat16),
        "position_ids": torch.arange(128, dtype=torch.int64),
        "scale": torch.tensor(0.125),  # 0-d
        "transposed": torch.randn(8, 16, generator=g).t(),  # non-contiguous
        "empty": torch.zeros(0, 4),
    }


def _assert_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def _shard_path(location: Location, version: int, file: str) -> str:
    return location.join("weights", f"v{version:08d}", file)


def test_round_trip_is_bit_exact_and_manifest_is_right(run_location):
    store = WeightStore(run_location)
    state = _state_dict()
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "dims": (1, 2)}
    manifest = store.publish(1, state, model_config=config)

    tensors, loaded = store.load(1)
    _assert_exact(tensors, state)
    assert loaded == manifest
    assert loaded.version == 1
    assert loaded.model_config == {**config, "dims": [1, 2]}
    assert datetime.fromisoformat(loaded.created_at).tzinfo is not None
    assert [s.file for s in loaded.shards] == ["model-00001-of-00001.safetensors"]
    assert loaded.tensors["scale"] == ("float32", ())
    assert loaded.tensors["layers.0.mlp.weight"] == ("bfloat16", (32, 48))
    assert loaded.tensors["transposed"] == ("float32", (16, 8))
    stored = run_location.fs.cat_file(_shard_path(run_location, 1, loaded.shards[0].file))
    assert loaded.shards[0].size == len(stored)
    assert loaded.shards[0].sha256 == hashlib.sha256(stored).hexdigest()
    assert WeightManifest.from_json(manifest.to_json()) == manifest
    _assert_exact(store.load()[0], state)  # default: latest


def test_small_shard_bytes_gives_many_shards_each_tensor_once(run_location):
    store = WeightStore(run_location)
    state = _state_dict()
    manifest = store.publish(3, state, shard_bytes=4096)  # embed (8 KiB) exceeds it: alone

    files = [s.file for s in manifest.shards]
    assert files == [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [list(shard.tensors) for shard in manifest.shards] == [
        ["embed.weight"],  # 8192 bytes
        ["layers.0.mlp.weight", "layers.0.mlp.bias"],  # 3072 + 96; + 1024 would exceed 4096
        ["position_ids", "scale", "transposed", "empty"],
    ]
    assert manifest.weight_map["scale"] == files[2]
    for shard in manifest.shards:
        assert run_location.fs.exists(_shard_path(run_location, 3, shard.file))

    streamed = list(store.iter_tensors(3))
    assert sorted(name for name, _ in streamed) == sorted(state)
    _assert_exact(dict(streamed), state)


def test_tied_weights_are_stored_under_every_name(run_location):
    embed = torch.randn(16, 8)
    state = {"model.embed_tokens.weight": embed, "lm_head.weight": embed, "norm": embed[0]}
    store = WeightStore(run_location)
    store.publish(1, state)
    tensors, manifest = store.load(1)
    assert set(manifest.tensors) == set(state)
    _assert_exact(tensors, state)


def test_latest_follows_publishes_and_versions_need_a_manifest(run_location):
    store = WeightStore(run_location)
    assert store.latest_version() is None
    assert store.versions() == []
    with pytest.raises(WeightVersionNotFoundError, match="no weights published"):
        store.load()
    store.publish(1, _state_dict(1))
    assert store.latest_version() == 1
    store.publish(2, _state_dict(2))
    assert (store.latest_version(), store.versions()) == (2, [1, 2])
    _assert_exact(store.load()[0], _state_dict(2))

    fs = run_location.fs
    fs.makedirs(run_location.join("weights", "v00000005"), exist_ok=True)
    fs.pipe_file(_shard_path(run_location, 5, "model-00001-of-00001.safetensors"), b"partial")
    assert store.versions() == [1, 2]  # a folder without manifest is invisible
    fs.pipe_file(run_location.join("weights", "LATEST"), json.dumps({"version": 5}).encode())
    assert store.latest_version() == 2  # LATEST naming a version without manifest: not trusted
    fs.rm_file(run_location.join("weights", "LATEST"))
    assert store.latest_version() == 2  # died between manifest and LATEST: the manifest counts
    fs.pipe_file(run_location.join("weights", "LATEST"), b"garbage")
    with pytest.raises(WeightIntegrityError, match="LATEST is malformed"):
        store.latest_version()


_KILLED_PUBLISHER = """
import json, sys, time, torch
from storage.fs import open_location
from storage.weights import WeightStore
uri, options = json.loads(sys.stdin.readline())
store = WeightStore(open_location(uri, storage_options=options))
state = {f"layers.{i}.weight": torch.randn(256, 1024) for i in range(4)}
shards = store.write_shards(2, state, shard_bytes=1024**2)
print(json.dumps([shard.file for shard in shards]), flush=True)
time.sleep(300)
store.commit(2, shards)
"""


def test_publisher_killed_before_manifest_is_invisible(run_uri_and_options, tmp_path):
    uri, options = run_uri_and_options
    location = open_location(uri, storage_options=options)
    store = WeightStore(location)
    store.publish(1, _state_dict(1))

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
        assert all(location.fs.exists(_shard_path(location, 2, f)) for f in files)
    finally:
        publisher.send_signal(signal.SIGKILL)
        publisher.wait(timeout=30)
    assert publisher.returncode == -signal.SIGKILL

    assert store.versions() == [1]
    assert store.latest_version() == 1
    with pytest.raises(WeightVersionNotFoundError, match=r"available versions: \[1\]"):
        store.load(2)
    with pytest.raises(WeightVersionNotFoundError, match="version 2"):
        store.iter_tensors(2)
    assert store.retain(keep=5) == []  # v2 is newer than every manifest: may be in progress
    assert location.fs.exists(_shard_path(location, 2, files[0]))

    store.publish(3, _state_dict(3))
    assert (store.versions(), store.latest_version()) == ([1, 3], 3)
    assert store.retain(keep=5) == [2]  # now a dead publish
    assert not location.fs.exists(_shard_path(location, 2, files[0]))
    assert store.versions() == [1, 3]
    _assert_exact(store.load(1)[0], _state_dict(1))


def test_tampered_shard_raises_integrity_error(run_location):
    store = WeightStore(run_location)
    manifest = store.publish(1, _state_dict(), shard_bytes=4096)
    shard = manifest.shards[-1]
    path = _shard_path(run_location, 1, shard.file)
    data = bytearray(run_location.fs.cat_file(path))
    data[-1] ^= 0x01  # a flipped bit in the last tensor's payload
    run_location.fs.pipe_file(path, bytes(data))
    actual = hashlib.sha256(data).hexdigest()

    pattern = rf"version 1 shard {shard.file} .*{shard.sha256}.*{actual}"
    with pytest.raises(WeightIntegrityError, match=pattern):
        store.load(1)
    streamed = store.iter_tensors(1)
    with pytest.raises(WeightIntegrityError, match=pattern):
        list(streamed)


def test_malformed_manifest_raises_integrity_error(run_location):
    store = WeightStore(run_location)
    manifest = store.publish(1, _state_dict())
    raw = json.loads(manifest.to_json())
    raw["shards"][0]["sha256"] = "not-a-digest"
    path = run_location.join("weights", "v00000001", "manifest.json")
    run_location.fs.pipe_file(path, json.dumps(raw).encode())
    with pytest.raises(WeightIntegrityError, match="64 hex digits"):
        store.load(1)


def test_retain_keeps_newest_and_latest(run_location):
    store = WeightStore(run_location)
    small = {"w": torch.ones(2)}
    for version in (1, 2, 3, 4):
        store.publish(version, small)
    assert store.retain(keep=2) == [1, 2]
    assert store.versions() == [3, 4]

    latest = run_location.join("weights", "LATEST")
    run_location.fs.pipe_file(latest, json.dumps({"version": 3}).encode())  # e.g. a rollback
    assert store.retain(keep=1) == []
    assert store.versions() == [3, 4]
    store.publish(5, small)
    run_location.fs.pipe_file(latest, json.dumps({"version": 3}).encode())
    assert store.retain(keep=1) == [4]
    assert store.versions() == [3, 5]
    assert store.latest_version() == 3
    with pytest.raises(ValueError, match="keep must be an int >= 1"):
        store.retain(keep=0)


def test_publishing_a_committed_version_fails(run_location):
    store = WeightStore(run_location)
    store.publish(1, _state_dict(1))
    with pytest.raises(WeightVersionExistsError, match="version 1 is already committed"):
        store.publish(1, _state_dict(2))
    shards = store.write_shards(2, _state_dict(2))
    store.commit(2, shards)
    with pytest.raises(WeightVersionExistsError, match="publish a version > 2"):
        store.commit(2, shards)
    _assert_exact(store.load(1)[0], _state_dict(1))  # untouched


def test_commit_refuses_missing_shards(tmp_path):
    location = open_location(str(tmp_path / "run"))
    store = WeightStore(location)
    shards = store.write_shards(1, _state_dict(), shard_bytes=4096)
    location.fs.rm_file(_shard_path(location, 1, shards[1].file))
    with pytest.raises(WeightIntegrityError, match=f"shard {shards[1].file} is missing"):
        store.commit(1, shards)
    assert store.versions() == []
    assert store.latest_version() is None


@pytest.mark.parametrize("version", [0, -1, 1.5, True, "3"])
def test_bad_versions_are_refused(tmp_path, version):
    store = WeightStore(open_location(str(tmp_path / "run")))
    with pytest.raises(ValueError, match="weight version must be an int >= 1"):
        store.publish(version, {"w": torch.ones(1)})
    assert store.versions() == []


def test_bad_state_dicts_and_configs_are_refused(tmp_path):
    store = WeightStore(open_location(str(tmp_path / "run")))
    with pytest.raises(TypeError, match=r"state_dict\['b'\] is a list, not a Tensor"):
        store.publish(1, {"a": torch.ones(1), "b": [1.0]})
    with pytest.raises(ValueError, match="state_dict is empty"):
        store.publish(1, {})
    with pytest.raises(ValueError, match="shard_bytes must be an int >= 1"):
        store.publish(1, {"a": torch.ones(1)}, shard_bytes=0)
    with pytest.raises(TypeError, match="model_config must be JSON-serialisable"):
        store.publish(1, {"a": torch.ones(1)}, model_config={"dtype": torch.float32})
    assert store.versions() == []


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused_before_anything_is_written(run_location, bad):
    """A NaN/inf tensor (a diverged learner) is never published: clear error naming it,
    no object of the version written, LATEST still on the previous version."""
    store = WeightStore(run_location)
    store.publish(1, _state_dict(0))
    state = _state_dict(1)
    state["layers.0.mlp.bias"][3] = bad
    with pytest.raises(NonFiniteWeightsError, match=r"v2: 1 tensor\(s\) hold NaN or inf"):
        store.publish(2, state)
    assert store.versions() == [1]
    assert store.latest_version() == 1
    assert not run_location.fs.exists(run_location.join("weights", "v00000002"))
    _assert_exact(store.load()[0], _state_dict(0))
