"""Readers of weight versions on a local folder and on SeaweedFS: `WeightFollower` skips
corrupt and vanished versions, detects a delta chain with a missing or corrupted link and
applies a good delta to the version it holds in place (retention under a reader:
test_weight_retention.py)."""

from __future__ import annotations

import pytest
import torch

from storage.fs import Location
from storage.weights.follower import Advance, WeightFollower
from storage.weights.publish import WeightWriter
from storage.weights.versions import WeightIntegrityError, WeightStore, WeightVersionNotFoundError


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(16, 8, generator=g), "bias": torch.randn(8, generator=g)}


def _next_state(state: dict[str, torch.Tensor], row: int) -> dict[str, torch.Tensor]:
    """`state` with one row of the embedding changed: a small delta."""
    new = {name: tensor.clone() for name, tensor in state.items()}
    new["embed.weight"][row] += 1.0
    return new


def _publish(writer: WeightWriter, states: dict, version: int, *, full: bool = False) -> None:
    """Publish `version` (state derived from the previous one), as a delta unless `full`."""
    states[version] = _next_state(states[version - 1], version) if version > 1 else _state(0)
    base = None if full or version == 1 else (version - 1, states[version - 1])
    manifest = writer.publish(version, states[version], base=base)
    assert manifest.base == (None if base is None else version - 1)


def _assert_holds(follower: WeightFollower, version: int, states: dict) -> None:
    assert follower.version == version
    for name, tensor in states[version].items():
        assert torch.equal(follower.tensors()[name], tensor), name


def _tamper(location: Location, version: int, name: str) -> None:
    path = location.join("weights", f"v{version:08d}", name)
    data = bytearray(location.fs.cat_file(path))
    data[-1] ^= 0xFF
    location.fs.pipe_file(path, bytes(data))


def _data_file(store: WeightStore, version: int) -> str:
    (file,) = store.read_manifest(version).files
    return file.file


def test_the_newest_intact_version_is_built_and_the_bad_ones_reported(run_location):
    writer, store = WeightWriter(run_location), WeightStore(run_location)
    states: dict = {}
    assert WeightFollower(store).advance() == Advance(None)
    for version in range(1, 6):
        _publish(writer, states, version, full=True)
    _tamper(run_location, 5, _data_file(store, 5))
    _tamper(run_location, 4, "manifest.json")

    follower = WeightFollower(store)
    found = follower.advance()
    assert (found.version, sorted(found.corrupt), found.vanished) == (3, [4, 5], [])
    assert f"file {_data_file(store, 5)} is corrupt" in found.corrupt[5]
    assert "manifest" in found.corrupt[4]
    _assert_holds(follower, 3, states)

    # A reader at v3 that knows 4 and 5 are corrupt reads nothing until v6 arrives.
    assert follower.advance(skip={4, 5}) == Advance(None)
    _assert_holds(follower, 3, states)
    _publish(writer, states, 6, full=True)  # a delta on the corrupt v5 could not be built
    assert follower.advance(skip={4, 5}) == Advance(6)
    _assert_holds(follower, 6, states)
    # Everything above `newer_than` corrupt: nothing built, the corrupt ones reported.
    nothing = WeightFollower(store).advance(newer_than=3, skip={6})
    assert (nothing.version, sorted(nothing.corrupt)) == (None, [4, 5])
    with pytest.raises(WeightIntegrityError, match=r"version 5 file .* is corrupt"):
        WeightFollower(store).advance(exactly=5)


def test_a_version_deleted_while_being_read_is_reported_as_vanished(run_location):
    writer, store = WeightWriter(run_location), WeightStore(run_location)
    states: dict = {}
    for version in (1, 2, 3):
        _publish(writer, states, version, full=True)
    run_location.fs.rm_file(run_location.join("weights", "v00000003", _data_file(store, 3)))
    follower = WeightFollower(store)
    assert follower.advance() == Advance(2, vanished=[3])
    _assert_holds(follower, 2, states)

    manifest = store.read_manifest(2)  # a reader has the manifest; retention deletes v2
    run_location.fs.pipe_file(run_location.join("weights", "LATEST"), b'{"version": 1}')
    assert writer.retain(keep=1) == [2]
    with pytest.raises(WeightVersionNotFoundError, match="version 2 vanished while reading"):
        list(store.read_pieces(manifest))
    with pytest.raises(WeightVersionNotFoundError, match=r"available versions: \[1, 3\]"):
        store.load(2)


def test_a_chain_with_a_missing_link_falls_back_to_the_full_version(run_location):
    writer, store = WeightWriter(run_location), WeightStore(run_location)
    states: dict = {}
    _publish(writer, states, 1)
    at_1 = WeightFollower(store)
    assert at_1.advance() == Advance(1)
    for version in (2, 3, 4):
        _publish(writer, states, version)
    run_location.fs.rm_file(run_location.join("weights", "v00000002", "manifest.json"))

    with pytest.raises(WeightIntegrityError, match="version 2, which 3 is a delta against"):
        store.chain(4)
    fresh = WeightFollower(store)
    found = fresh.advance()
    assert (found.version, sorted(found.corrupt)) == (1, [3, 4])
    assert "has no manifest" in found.corrupt[4]
    _assert_holds(fresh, 1, states)
    assert at_1.advance().version is None  # holding the version before the link: stays
    _assert_holds(at_1, 1, states)

    _publish(writer, states, 5, full=True)
    for follower in (fresh, at_1):
        assert follower.advance() == Advance(5)
        _assert_holds(follower, 5, states)
    assert writer.retain(keep=1) == [1, 2, 3, 4]  # v2's folder, manifest gone, is a dead one


def test_a_corrupted_link_is_detected_and_good_deltas_apply_in_place(run_location):
    writer, store = WeightWriter(run_location), WeightStore(run_location)
    states: dict = {}
    followers = {}
    for version in (1, 2, 3):
        _publish(writer, states, version)
        followers[version] = WeightFollower(store)
        assert followers[version].advance() == Advance(version)
    held_3 = followers[3].tensors()["embed.weight"]
    _tamper(run_location, 3, _data_file(store, 3))  # after the follower at 3 read it
    _publish(writer, states, 4)

    # The follower at 3 applies v4's delta in place: it never reads v3's (now corrupt) file.
    assert followers[3].advance() == Advance(4)
    _assert_holds(followers[3], 4, states)
    assert followers[3].tensors()["embed.weight"].data_ptr() == held_3.data_ptr()
    assert torch.equal(held_3, states[4]["embed.weight"])

    # Any other reader must rebuild v3, and cannot.
    fresh = WeightFollower(store)
    found = fresh.advance()
    assert (found.version, sorted(found.corrupt)) == (2, [3, 4])
    assert f"version 3 file {_data_file(store, 3)} is corrupt" in found.corrupt[3]
    assert found.corrupt[4] == found.corrupt[3]  # v4 is built through v3
    _assert_holds(fresh, 2, states)
    assert followers[2].advance() == Advance(None, found.corrupt)  # stays where it is
    _assert_holds(followers[2], 2, states)
    assert followers[1].advance().version == 2  # up to the link, in place
    _assert_holds(followers[1], 2, states)

    _publish(writer, states, 5, full=True)
    for follower in (fresh, *followers.values()):
        assert follower.advance().version == 5
        _assert_holds(follower, 5, states)


def test_a_follower_that_does_not_hold_rebuilds_each_version_from_its_full_version(
    run_location,
):
    writer, store = WeightWriter(run_location), WeightStore(run_location)
    states: dict = {}
    for version in (1, 2):
        _publish(writer, states, version)
    follower = WeightFollower(store, hold=False)
    assert follower.advance() == Advance(2)
    _assert_holds(follower, 2, states)
    follower.release()
    with pytest.raises(RuntimeError, match="call advance"):
        follower.tensors()
    _publish(writer, states, 3)
    assert follower.advance() == Advance(3)
    _assert_holds(follower, 3, states)


def test_a_new_full_version_is_built_into_the_memory_already_held(run_location: Location):
    writer, store, states = WeightWriter(run_location), WeightStore(run_location), {}
    _publish(writer, states, 1)
    follower = WeightFollower(store)
    assert follower.advance() == Advance(1)
    held = {name: tensor.data_ptr() for name, tensor in follower.tensors().items()}
    _publish(writer, states, 2, full=True)  # not built from 1: the full version is read whole
    assert follower.advance() == Advance(2)
    assert {name: t.data_ptr() for name, t in follower.tensors().items()} == held
    for name, tensor in states[2].items():
        assert torch.equal(follower.tensors()[name], tensor)
