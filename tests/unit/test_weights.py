"""Weight store on a local folder and on SeaweedFS: round trips, manifests, LATEST, a publisher
killed by SIGKILL before its manifest, tampered files, bad input and delta versions (a publish
sharded over learner ranks: test_weight_sharding.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
import safetensors.torch
import torch
import xxhash

from storage.fs import Location, open_location
from storage.weight_shares import NonFiniteWeightsError, whole_shares
from storage.weights import (
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
        "layers.0.mlp.weight": torch.randn(33, 48, generator=g).to(torch.bfloat16),  # odd rows
        "layers.0.mlp.bias": torch.randn(48, generator=g).to(torch.bfloat16),
        "position_ids": torch.arange(128, dtype=torch.int64),
        "scale": torch.tensor(0.125),  # 0-d
        "head.bias": torch.randn(1, 5, generator=g),  # fewer rows than two ranks
        "transposed": torch.randn(8, 16, generator=g).t(),  # non-contiguous
        "empty": torch.zeros(0, 4),
    }


def _xxh3(tensor: torch.Tensor) -> str:
    """Reference checksum: xxh3-128 of the tensor's row-major bytes (bf16 as its 16 bits)."""
    flat = tensor.reshape(-1).contiguous()
    flat = flat.view(torch.int16) if flat.dtype == torch.bfloat16 else flat
    return xxhash.xxh3_128_hexdigest(flat.numpy().tobytes())


def _assert_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert _xxh3(got[name]) == _xxh3(tensor), name  # bits, so -0.0 and 0.0 differ


def _path(location: Location, version: int, file: str) -> str:
    return location.join("weights", f"v{version:08d}", file)


def test_round_trip_is_bit_exact_and_manifest_is_right(run_location):
    store = WeightStore(run_location)
    state = _state_dict()
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "dims": (1, 2)}
    manifest = store.publish(1, state, model_config=config)

    tensors, loaded = store.load(1)
    _assert_exact(tensors, state)
    assert loaded == manifest
    assert (loaded.version, loaded.base, loaded.checksum) == (1, None, "xxh3_128")
    assert loaded.model_config == {**config, "dims": [1, 2]}
    assert datetime.fromisoformat(loaded.created_at).tzinfo is not None
    for name, tensor in state.items():
        entry = loaded.tensors[name]
        assert (entry.dtype, entry.shape) == (str(tensor.dtype)[6:], tuple(tensor.shape))
        if tensor.numel():
            (piece,) = entry.pieces
            assert (piece.start, piece.stop, piece.encoding) == (0, tensor.numel(), "full")
            assert piece.checksum == _xxh3(tensor)
        else:
            assert entry.pieces == ()
    (file,) = loaded.files
    assert file.file.endswith("-r00000-00001.safetensors")
    stored = run_location.fs.cat_file(_path(run_location, 1, file.file))
    assert (file.size, file.checksum) == (len(stored), xxhash.xxh3_128_hexdigest(stored))
    assert WeightManifest.from_json(manifest.to_json()) == manifest
    assert store.chain(1) == [manifest]
    _assert_exact(store.load()[0], state)  # default: latest


def test_small_shard_bytes_gives_many_files_each_piece_once(run_location):
    store = WeightStore(run_location)
    state = _state_dict()
    manifest = store.publish(3, state, shard_bytes=4096)  # embed (8 KiB) exceeds it: alone

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
    fs.pipe_file(_path(run_location, 5, "dead-r00000-00001.safetensors"), b"partial")
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
from storage.weight_shares import whole_shares
from storage.weights import WeightStore
uri, options = json.loads(sys.stdin.readline())
store = WeightStore(open_location(uri, storage_options=options))
state = {f"layers.{i}.weight": torch.randn(256, 1024) for i in range(4)}
part = store.write_share(2, whole_shares(state), publish_id="killed", rank=0, world=1,
                         shard_bytes=1024**2)
print(json.dumps([file.file for file in part.files]), flush=True)
time.sleep(300)
store.commit(2, publish_id="killed", world=1)
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
        assert all(location.fs.exists(_path(location, 2, f)) for f in files)
    finally:
        publisher.send_signal(signal.SIGKILL)
        publisher.wait(timeout=30)
    assert publisher.returncode == -signal.SIGKILL

    assert store.versions() == [1]
    assert store.latest_version() == 1
    with pytest.raises(WeightVersionNotFoundError, match=r"available versions: \[1\]"):
        store.load(2)
    assert store.retain(keep=5) == []  # v2 is newer than every manifest: may be in progress
    assert location.fs.exists(_path(location, 2, files[0]))

    store.publish(3, _state_dict(3))
    assert (store.versions(), store.latest_version()) == ([1, 3], 3)
    assert store.retain(keep=5) == [2]  # now a dead publish
    assert not any(location.fs.exists(_path(location, 2, f)) for f in files)
    assert store.retain(keep=5) == []
    assert store.versions() == [1, 3]
    _assert_exact(store.load(1)[0], _state_dict(1))


def _folder(location: Location, version: int) -> set[str]:
    """The names of the objects in the folder of `version`."""
    folder = location.join("weights", f"v{version:08d}")
    return {path.rsplit("/", 1)[1] for path in location.fs.find(folder)}


def test_a_dead_publishs_leftovers_in_a_committed_version_are_removed(run_location):
    """A learner life died mid-publish of v2 (some files, one with its part record, another
    without); the next life publishes v2 under its own id. Retention removes every object the
    manifest does not name: the dead life's files and the part records, never the version."""
    store = WeightStore(run_location)
    store.publish(1, _state_dict(1))
    shares = whole_shares(_state_dict(2))
    store.write_share(2, shares, publish_id="dead1", rank=0, world=1, shard_bytes=4096)
    dead_files = store.write_share(2, shares, publish_id="dead2", rank=0, world=2).files
    run_location.fs.rm_file(_path(run_location, 2, "dead2-part-00000-of-00002.json"))
    store.write_share(2, whole_shares(_state_dict(3)), publish_id="live", rank=0, world=1)
    manifest = store.commit(2, publish_id="live", world=1)
    named = {"manifest.json", *(entry.file for entry in manifest.files)}
    assert {f.file for f in dead_files} < _folder(run_location, 2) - named

    assert store.retain(keep=5) == []  # no version deleted, only what no manifest names
    assert _folder(run_location, 2) == named
    assert _folder(run_location, 1) == {"manifest.json", store.read_manifest(1).files[0].file}
    _assert_exact(store.load(2)[0], _state_dict(3))
    _assert_exact(store.load(1)[0], _state_dict(1))
    with pytest.raises(WeightVersionExistsError, match="version 2 is already committed"):
        store.commit(2, publish_id="dead1", world=1)  # its part is gone; refused at once
    assert store.commit(2, publish_id="live", world=1) == manifest  # a retry needs no part


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
    store = WeightStore(run_location, fence=fence)
    assert store.publish(1, _state_dict(1)).epoch == 7
    assert fence.checks == 2  # before the manifest, before LATEST
    assert store.read_manifest(1).epoch == 7
    assert WeightStore(run_location).publish(2, _state_dict(2)).epoch is None  # no lease
    raw = json.loads(run_location.fs.cat_file(_path(run_location, 2, "manifest.json")))
    assert "epoch" not in raw  # what a release before leases wrote, and still reads
    assert store.read_manifest(2).epoch is None

    lost = WeightStore(run_location, fence=_Fence(epoch=7, checks=0))
    lost.write_share(3, whole_shares(_state_dict(3)), publish_id="p", rank=0, world=1)
    with pytest.raises(_LeaseLostError):
        lost.commit(3, publish_id="p", world=1)
    assert not run_location.fs.exists(_path(run_location, 3, "manifest.json"))
    assert (store.versions(), _latest(run_location)) == ([1, 2], 2)

    lost_after_manifest = WeightStore(run_location, fence=_Fence(epoch=8, checks=1))
    with pytest.raises(_LeaseLostError):
        lost_after_manifest.commit(3, publish_id="p", world=1)
    assert store.read_manifest(3).epoch == 8  # committed, but LATEST did not move
    assert (store.versions(), _latest(run_location)) == ([1, 2, 3], 2)
    with pytest.raises(_LeaseLostError):  # a retry by a learner that lost its lease moves nothing
        WeightStore(run_location, fence=_Fence(epoch=8, checks=0)).commit(
            3, publish_id="p", world=1
        )
    assert _latest(run_location) == 2

    # retain(keep=1) deletes v1 (LATEST names v2) and v3's part record, each after a check.
    before = {v: _folder(run_location, v) for v in (1, 2, 3)}
    assert "p-part-00000-of-00001.json" in before[3]
    with pytest.raises(_LeaseLostError):
        WeightStore(run_location, fence=_Fence(epoch=9, checks=0)).retain(keep=1)
    assert {v: _folder(run_location, v) for v in (1, 2, 3)} == before
    with pytest.raises(_LeaseLostError):  # lost after v1 went
        WeightStore(run_location, fence=_Fence(epoch=9, checks=1)).retain(keep=1)
    assert store.versions() == [2, 3]
    assert {v: _folder(run_location, v) for v in (2, 3)} == {v: before[v] for v in (2, 3)}
    assert store.retain(keep=1) == []
    assert "p-part-00000-of-00001.json" not in _folder(run_location, 3)
    assert store.commit(3, publish_id="p", world=1).epoch == 8  # the retry that moves LATEST
    assert _latest(run_location) == 3


def test_tampered_or_truncated_file_raises_integrity_error(run_location):
    store = WeightStore(run_location)
    manifest = store.publish(1, _state_dict(), shard_bytes=4096)
    file = manifest.files[-1]
    path = _path(run_location, 1, file.file)
    intact = run_location.fs.cat_file(path)
    flipped = bytearray(intact)
    flipped[-1] ^= 0x01  # a flipped bit in the last tensor's payload
    for data in (bytes(flipped), intact[: len(intact) // 2]):
        run_location.fs.pipe_file(path, data)
        actual = xxhash.xxh3_128_hexdigest(data)
        pattern = rf"version 1 file {file.file} is corrupt: .*{file.checksum}, got {len(data)} "
        with pytest.raises(WeightIntegrityError, match=pattern + f"bytes with {actual}"):
            store.load(1)


def _manifest_json(**changes) -> str:
    raw = {
        "format": "streamrl.weights.v2",
        "version": 2,
        "base": 1,
        "tensors": {
            "w": {
                "dtype": "float32",
                "shape": [2, 3],
                "pieces": [
                    {"start": 0, "stop": 4, "file": "a", "encoding": "delta", "checksum": "0" * 32},
                    {"start": 4, "stop": 6, "file": "b", "encoding": "full", "checksum": "1" * 32},
                ],
            }
        },
        "files": [
            {"file": "a", "size": 10, "checksum": "2" * 32},
            {"file": "b", "size": 5, "checksum": "3" * 32},
        ],
        "model_config": {},
        "created_at": "2026-01-01T00:00:00+00:00",
        "checksum": "xxh3_128",
    }
    for dotted, value in changes.items():
        *parents, key = dotted.split(".")
        node = raw
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[int(key) if isinstance(node, list) else key] = value
    return json.dumps(raw)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"format": "streamrl.weights.v1"}, "written by another streamrl release"),
        ({"base": 2}, "base 2 is not older than version 2"),
        ({"base": None}, "holds a delta piece in a full version"),
        ({"tensors.w.pieces.1.start": 5}, "pieces of 'w' do not cover it"),
        ({"tensors.w.pieces.1.stop": 7}, "past the 6 elements"),
        ({"tensors.w.pieces.0.stop": 5}, "overlap or are out of order"),
        ({"tensors.w.pieces.1.file": "c"}, "name files the manifest does not list"),
        ({"tensors.w.pieces.1.encoding": "zip"}, "must be full or delta"),
        ({"tensors.w.dtype": "float99"}, "unknown dtype"),
        ({"files.1.file": "a"}, "a file is listed twice"),
        ({"files.0.file": "../a"}, "must be a plain name"),
        ({"files.0.size": 0}, "size of a must be an int >= 1"),
        ({"checksum": "sha256"}, "is not 'xxh3_128'"),
        ({"tensors": {}}, "needs at least one tensor"),
        ({"created_at": "yesterday"}, "isoformat"),
        ({"model_config": []}, "model_config must be a JSON object"),
        ({"surprise": 1}, "malformed weight manifest"),
    ],
)
def test_bad_manifests_are_refused(changes, match):
    WeightManifest.from_json(_manifest_json())  # the unchanged one is valid
    with pytest.raises(ValueError, match=match):
        WeightManifest.from_json(_manifest_json(**changes))


def test_malformed_or_misplaced_manifest_raises_integrity_error(run_location):
    store = WeightStore(run_location)
    manifest = store.publish(1, _state_dict())
    raw = json.loads(manifest.to_json())
    raw["files"][0]["checksum"] = "not-a-digest"
    path = _path(run_location, 1, "manifest.json")
    run_location.fs.pipe_file(path, json.dumps(raw).encode())
    with pytest.raises(WeightIntegrityError, match="is not 32 hex digits"):
        store.load(1)
    run_location.fs.makedirs(_path(run_location, 2, ""), exist_ok=True)
    run_location.fs.pipe_file(_path(run_location, 2, "manifest.json"), manifest.to_json().encode())
    with pytest.raises(WeightIntegrityError, match="manifest of v00000002 says 1"):
        store.load(2)


def test_versions_are_immutable(run_location):
    store = WeightStore(run_location)
    store.publish(1, _state_dict(1))
    with pytest.raises(WeightVersionExistsError, match="version 1 is already committed"):
        store.publish(1, _state_dict(2))
    store.write_share(2, whole_shares(_state_dict(2)), publish_id="p", rank=0, world=1)
    manifest = store.commit(2, publish_id="p", world=1)
    assert store.commit(2, publish_id="p", world=1) == manifest  # a retry: nothing changes
    with pytest.raises(WeightVersionExistsError, match="publish a version > 2"):
        store.commit(2, publish_id="q", world=1)
    with pytest.raises(WeightVersionExistsError, match="version 2 is already committed"):
        store.write_share(2, whole_shares(_state_dict(3)), publish_id="q", rank=0, world=1)
    _assert_exact(store.load(1)[0], _state_dict(1))  # untouched
    _assert_exact(store.load(2)[0], _state_dict(2))


def test_commit_refuses_missing_files(tmp_path):
    location = open_location(str(tmp_path / "run"))
    store = WeightStore(location)
    part = store.write_share(
        1, whole_shares(_state_dict()), publish_id="p", rank=0, world=1, shard_bytes=4096
    )
    location.fs.rm_file(_path(location, 1, part.files[1].file))
    with pytest.raises(WeightIntegrityError, match=f"{part.files[1].file} is missing"):
        store.commit(1, publish_id="p", world=1)
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
    with pytest.raises(ValueError, match="base version 1 must be in"):
        store.publish(1, {"a": torch.ones(1)}, base=(1, {"a": torch.ones(1)}))
    with pytest.raises(ValueError, match="base piece of 'a' differs in shape"):
        store.publish(2, {"a": torch.ones(1)}, base=(1, {"a": torch.ones(2)}))
    assert store.versions() == []
    assert not store.fs.exists(store.root.path)


def test_non_finite_weights_are_refused_before_anything_is_written(run_location):
    """A NaN/inf tensor (a diverged learner) is never published: clear error naming it,
    no object of the version written, LATEST still on the previous version."""
    store = WeightStore(run_location)
    store.publish(1, _state_dict(0))
    for bad in (float("nan"), float("inf"), -float("inf")):
        state = _state_dict(1)
        state["layers.0.mlp.bias"][3] = bad
        with pytest.raises(NonFiniteWeightsError, match=r"v2: 1 tensor\(s\) hold NaN or inf"):
            store.publish(2, state, base=(1, _state_dict(0)))
        with pytest.raises(NonFiniteWeightsError, match=r"layers\.0\.mlp\.bias"):
            store.write_share(2, whole_shares(state), publish_id="p", rank=0, world=1)
    assert store.versions() == [1]
    assert store.latest_version() == 1
    assert not run_location.fs.exists(run_location.join("weights", "v00000002"))
    _assert_exact(store.load()[0], _state_dict(0))


# -- deltas ---------------------------------------------------------------------------------


def test_delta_version_is_bit_exact_and_stores_only_the_changed_elements(run_location):
    store = WeightStore(run_location)
    old = _state_dict(0)
    old["embed.weight"][0, 0] = 0.0
    new = {name: tensor.clone() for name, tensor in old.items()}
    new["embed.weight"][0, 0] = -0.0  # equal as a value, not as bits
    new["embed.weight"][9, 31] += 1.0
    new["layers.0.mlp.bias"][47] = 2.0
    first = store.publish(1, old)
    # Tiny files: a delta's positions and values still share one file.
    manifest = store.publish(2, new, base=(1, old), shard_bytes=1)

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
    store = WeightStore(run_location)
    old, new = _state_dict(0), _state_dict(1)  # nearly every element differs
    store.publish(1, old)
    manifest = store.publish(2, new, base=(1, old), max_delta_ratio=0.5)
    assert manifest.base is None
    assert {p.encoding for e in manifest.tensors.values() for p in e.pieces} == {"full"}
    assert [m.version for m in store.chain(2)] == [2]
    _assert_exact(store.load(2)[0], new)


def test_a_delta_against_the_wrong_base_state_fails_its_checksums(run_location):
    store = WeightStore(run_location)
    store.publish(1, _state_dict(0))
    wrong = _state_dict(0)
    wrong["embed.weight"][0, 0] += 1.0  # the publisher's idea of v1 is not what v1 holds
    new = {name: tensor.clone() for name, tensor in wrong.items()}
    new["embed.weight"][1, 1] += 1.0
    store.publish(2, new, base=(1, wrong))
    with pytest.raises(WeightIntegrityError, match=r"'embed\.weight' .* does not match"):
        store.load(2)
