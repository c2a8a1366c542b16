"""Retention of weight versions on a local folder and on SeaweedFS: it keeps LATEST and what
kept deltas need, removes what no manifest names, and a reader racing it finds the versions it
removes vanished, never corrupt (the fence on each deletion: test_weight_publish.py)."""

from __future__ import annotations

import json

import pytest
import torch

from storage.fs import Location
from storage.weights.follower import Advance, WeightFollower
from storage.weights.publish import WeightVersionExistsError, WeightWriter
from storage.weights.shares import whole_shares
from storage.weights.versions import WeightIntegrityError, WeightStore, WeightVersionNotFoundError
from tests.unit.storage.weights.test_recovery import _publish
from tests.unit.storage.weights.test_versions import _assert_exact, _folder, _path, _state_dict


def test_a_dead_publishs_leftovers_in_a_committed_version_are_removed(run_location):
    """A learner life died mid-publish of v2 (some files, one with its part record, another
    without); the next life publishes v2 under its own id. Retention removes every object the
    manifest does not name: the dead life's files and the part records, never the version."""
    writer, store = WeightWriter(run_location), WeightStore(run_location)
    writer.publish(1, _state_dict(1))
    shares = whole_shares(_state_dict(2))
    writer.write_share(2, shares, publish_id="dead1", rank=0, world=1, shard_bytes=4096)
    dead_files = writer.write_share(2, shares, publish_id="dead2", rank=0, world=2).files
    run_location.fs.rm_file(_path(run_location, 2, "dead2-part-00000-of-00002.json"))
    writer.write_share(2, whole_shares(_state_dict(3)), publish_id="live", rank=0, world=1)
    manifest = writer.commit(2, publish_id="live", world=1)
    named = {"manifest.json", *(entry.file for entry in manifest.files)}
    assert {f.file for f in dead_files} < _folder(run_location, 2) - named

    assert writer.retain(keep=5) == []  # no version deleted, only what no manifest names
    assert _folder(run_location, 2) == named
    assert _folder(run_location, 1) == {"manifest.json", store.read_manifest(1).files[0].file}
    _assert_exact(store.load(2)[0], _state_dict(3))
    _assert_exact(store.load(1)[0], _state_dict(1))
    with pytest.raises(WeightVersionExistsError, match="version 2 is already committed"):
        writer.commit(2, publish_id="dead1", world=1)  # its part is gone; refused at once
    assert writer.commit(2, publish_id="live", world=1) == manifest  # a retry needs no part


def test_retain_keeps_latest_and_what_kept_deltas_need(run_location):
    writer, store = WeightWriter(run_location), WeightStore(run_location)
    states: dict = {}
    for version in range(1, 7):  # 1 full, 2-4 deltas, 5 full, 6 delta
        _publish(writer, states, version, full=version == 5)
    latest = run_location.join("weights", "LATEST")

    assert writer.retain(keep=3) == []  # 4 needs 3, 2 and 1
    run_location.fs.pipe_file(latest, json.dumps({"version": 3}).encode())  # e.g. a rollback
    assert writer.retain(keep=1) == [4]  # 6 needs 5; LATEST (3) needs 2 and 1
    assert store.versions() == [1, 2, 3, 5, 6]
    for version in (3, 6):
        tensors, _ = store.load(version)
        assert all(torch.equal(tensors[n], t) for n, t in states[version].items())

    chain_of_3 = store.chain(3)  # a reader of v3 has its manifests
    run_location.fs.pipe_file(latest, json.dumps({"version": 6}).encode())
    assert writer.retain(keep=2) == [1, 2, 3]
    assert store.versions() == [5, 6]
    assert store.latest_version() == 6
    with pytest.raises(WeightVersionNotFoundError, match="vanished while reading"):
        list(store.read_pieces(chain_of_3[0]))
    with pytest.raises(WeightVersionNotFoundError, match="version 3 has no manifest"):
        store.load(3)
    assert WeightFollower(store).advance(exactly=6) == Advance(6)
    assert writer.retain(keep=1) == []  # 6 needs 5
    with pytest.raises(ValueError, match="keep must be an int >= 1"):
        writer.retain(keep=0)


def test_a_reader_racing_retention_finds_versions_vanished_never_corrupt(
    run_location: Location, monkeypatch
):
    """After each deletion `retain` makes, a reader that listed the versions before it began
    builds each retired one: it is built or vanished (retried later, or passed over), never
    corrupt (skipped for good) — whichever link of a delta chain is gone at that moment."""
    writer, store, states = WeightWriter(run_location), WeightStore(run_location), {}
    for version in range(1, 7):  # 1 full, 2-4 deltas on it, 5 full, 6 delta
        _publish(writer, states, version, full=version == 5)
    reader = WeightStore(run_location)
    seen: list[tuple[int, str]] = []

    def probe() -> None:
        for version in (2, 3, 4):
            try:
                reader.build(version)
                seen.append((version, "built"))
            except WeightVersionNotFoundError:
                seen.append((version, "vanished"))
            except WeightIntegrityError as exc:
                seen.append((version, f"corrupt: {exc}"))
        found = WeightFollower(reader).advance(skip={5, 6})
        seen.extend((version, f"corrupt: {why}") for version, why in found.corrupt.items())

    fs = run_location.fs
    for method in ("rm", "rm_file"):
        delete = getattr(fs, method)

        def then_probe(*args, delete=delete, **kwargs):
            delete(*args, **kwargs)
            probe()

        monkeypatch.setattr(fs, method, then_probe)
    assert writer.retain(keep=2) == [1, 2, 3, 4]
    monkeypatch.undo()
    assert {state for _, state in seen} == {"built", "vanished"}, seen
    assert store.versions() == [5, 6]
