"""Readers skip bad weight versions: `WeightStore.load_newest_intact` on a local folder and on
SeaweedFS, with tampered shards, a broken manifest and a version deleted by retention."""

from __future__ import annotations

import torch

from storage.fs import Location, open_location
from storage.weights import WeightStore


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(16, 8, generator=g), "bias": torch.randn(8, generator=g)}


def _tamper(location: Location, version: int, name: str) -> None:
    path = location.join("weights", f"v{version:08d}", name)
    data = bytearray(location.fs.cat_file(path))
    data[-1] ^= 0xFF
    location.fs.pipe_file(path, bytes(data))


def test_the_newest_intact_version_is_loaded_and_the_bad_ones_reported(run_location: Location):
    store = WeightStore(run_location)
    assert store.load_newest_intact().version is None
    for version in range(1, 6):
        store.publish(version, _state(version))
    _tamper(run_location, 5, "model-00001-of-00001.safetensors")
    _tamper(run_location, 4, "manifest.json")

    found = store.load_newest_intact()
    assert found.version == 3
    assert torch.equal(found.tensors["embed.weight"], _state(3)["embed.weight"])
    assert sorted(found.corrupt) == [4, 5]
    assert "corrupt" in found.corrupt[5]
    assert "manifest" in found.corrupt[4]

    # A reader at v3 that knows 4 and 5 are corrupt reads nothing until v6 arrives.
    assert store.load_newest_intact(newer_than=3, skip={4, 5}).version is None
    store.publish(6, _state(6))
    assert store.load_newest_intact(newer_than=3, skip={4, 5}).version == 6
    # Everything above `newer_than` corrupt: nothing to load, the corrupt ones reported.
    nothing = store.load_newest_intact(newer_than=3, skip={6})
    assert (nothing.version, sorted(nothing.corrupt)) == (None, [4, 5])


def test_a_version_deleted_while_being_read_is_reported_as_vanished(tmp_path):
    location = open_location(str(tmp_path / "run"))
    store = WeightStore(location)
    for version in (1, 2):
        store.publish(version, _state(version))
    location.fs.rm_file(location.join("weights", "v00000002", "model-00001-of-00001.safetensors"))
    found = store.load_newest_intact()
    assert (found.version, found.vanished, found.corrupt) == (1, [2], {})
