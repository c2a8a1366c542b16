"""Reading weight versions on a local folder and on SeaweedFS: round trips, manifests, LATEST,
tampered files and a delta built on the wrong base; generators import only this side. Writing
a version: test_weight_publish.py (sharded over learner ranks: test_weight_sharding.py);
retention: test_weight_retention.py."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
import torch
import xxhash

from storage.fs import Location
from storage.weights.publish import WeightWriter
from storage.weights.versions import (
    WeightIntegrityError,
    WeightManifest,
    WeightStore,
    WeightVersionNotFoundError,
)

REPO_ROOT = Path(__file__).resolve().parents[4]


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


def _folder(location: Location, version: int) -> set[str]:
    """The names of the objects in the folder of `version`."""
    folder = location.join("weights", f"v{version:08d}")
    return {path.rsplit("/", 1)[1] for path in location.fs.find(folder)}


def test_round_trip_is_bit_exact_and_manifest_is_right(run_location):
    writer, store = WeightWriter(run_location), WeightStore(run_location)
    state = _state_dict()
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "dims": (1, 2)}
    manifest = writer.publish(1, state, model_config=config)

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


def test_tied_weights_are_stored_under_every_name(run_location):
    embed = torch.randn(16, 8)
    state = {"model.embed_tokens.weight": embed, "lm_head.weight": embed, "norm": embed[0]}
    writer, store = WeightWriter(run_location), WeightStore(run_location)
    writer.publish(1, state)
    tensors, manifest = store.load(1)
    assert set(manifest.tensors) == set(state)
    _assert_exact(tensors, state)


def test_latest_follows_publishes_and_versions_need_a_manifest(run_location):
    writer, store = WeightWriter(run_location), WeightStore(run_location)
    assert store.latest_version() is None
    assert store.versions() == []
    with pytest.raises(WeightVersionNotFoundError, match="no weights published"):
        store.load()
    writer.publish(1, _state_dict(1))
    assert store.latest_version() == 1
    writer.publish(2, _state_dict(2))
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


def test_tampered_or_truncated_file_raises_integrity_error(run_location):
    writer, store = WeightWriter(run_location), WeightStore(run_location)
    manifest = writer.publish(1, _state_dict(), shard_bytes=4096)
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
    writer, store = WeightWriter(run_location), WeightStore(run_location)
    manifest = writer.publish(1, _state_dict())
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


def test_a_delta_against_the_wrong_base_state_fails_its_checksums(run_location):
    writer, store = WeightWriter(run_location), WeightStore(run_location)
    writer.publish(1, _state_dict(0))
    wrong = _state_dict(0)
    wrong["embed.weight"][0, 0] += 1.0  # the publisher's idea of v1 is not what v1 holds
    new = {name: tensor.clone() for name, tensor in wrong.items()}
    new["embed.weight"][1, 1] += 1.0
    writer.publish(2, new, base=(1, wrong))
    with pytest.raises(WeightIntegrityError, match=r"'embed\.weight' .* does not match"):
        store.load(2)


_GENERATOR_SIDE = """
import importlib, json, pkgutil, sys
import storage.weights.follower
for package in ("streamrl.generator", "streamrl.evaluation"):  # every module of each
    module = importlib.import_module(package)
    for info in pkgutil.walk_packages(getattr(module, "__path__", []), package + "."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
print(json.dumps(sorted(m for m in sys.modules if m.startswith("storage."))))
"""


def test_generators_import_only_the_read_side():
    """Generators and the evaluator only read weight versions: nothing they import may pull
    in the writer (or its files, or retention), so the read side stands on its own."""
    result = subprocess.run(
        [sys.executable, "-c", _GENERATOR_SIDE],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    imported = json.loads(result.stdout.strip().splitlines()[-1])
    assert "storage.weights.versions" in imported  # the check would see the modules it looks for
    writers = ("storage.weights.publish", "storage.weights.files", "storage.weights.retention")
    for writing in writers:
        assert writing not in imported
