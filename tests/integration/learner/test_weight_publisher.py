"""The learner's publisher on real ranks: two gloo ranks each writing their FSDP2 shards
publish exactly what one rank publishes (full and delta versions, bf16); a failed upload is
retried; a version that cannot be committed fails the next publish (LATEST stays on the last
complete version); a rank whose share landed despite an error keeps a correct delta base."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from storage.fs import open_location
from storage.weights.publish import WeightWriter
from storage.weights.versions import WeightStore
from streamrl.learner.publish import PublishFailedError
from streamrl.learner.topology import Topology
from streamrl.models import resolve_model_path
from streamrl.placement import handoff
from streamrl.placement.handoff import HandOffReader, handoff_dir
from streamrl.placement.records import HANDOFF_VARIABLE
from tests.integration.learner import publish_worker as worker
from tests.integration.torchrun import torchrun


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("one-rank")
    with Topology.from_env("cpu") as topology:
        worker.publish_versions(str(run), topology)
    return run


def test_two_ranks_publish_exactly_what_one_rank_publishes(one_rank_run, tmp_path, monkeypatch):
    resolve_model_path(worker.MODEL)  # built once, before two ranks race to build it
    two = tmp_path / "two-ranks"
    torchrun(worker.__file__, f"--out={two}", env={HANDOFF_VARIABLE: "1"})
    one_store, two_store = (WeightStore(open_location(str(r))) for r in (one_rank_run, two))
    assert one_store.versions() == two_store.versions() == [1, 2, 3]
    for version in (1, 2, 3):
        one, one_manifest = one_store.load(version)
        two, two_manifest = two_store.load(version)
        assert list(one) == list(two)
        for name in one:
            assert one[name].dtype == torch.bfloat16, name
            assert torch.equal(one[name].view(torch.int16), two[name].view(torch.int16)), name
        assert one_manifest.base == two_manifest.base == (1 if version == 2 else None)
        # Two ranks wrote two pieces of every tensor with more than one row.
        wide = one_manifest.tensors["model.layers.0.mlp.up_proj.weight"]
        assert len(wide.pieces) == 1
        assert len(two_manifest.tensors["model.layers.0.mlp.up_proj.weight"].pieces) == 2
        assert {f.file.split("-r")[1][:5] for f in two_manifest.files} == {"00000", "00001"}
    full, delta = one_store.read_manifest(1), one_store.read_manifest(2)
    assert delta.stored_bytes < 0.1 * full.stored_bytes  # 1 % of elements changed

    # Both ranks left their shards of the last two versions in their hand-off slots: put
    # together, each is bit for bit what storage holds (v1's slot was reused by v3). The ranks
    # have exited: their host slots still hold the bytes, so the writer's liveness check (which
    # guards CUDA memory) is waived here.
    monkeypatch.setattr(handoff, "_alive", lambda pid: True)
    slots = handoff_dir(open_location(str(tmp_path / "two-ranks")).uri)
    try:
        reader = HandOffReader(slots)
        assert reader.take(two_store.read_manifest(1), torch.device("cpu")) is None
        for version in (2, 3):
            taken = reader.take(two_store.read_manifest(version), torch.device("cpu"))
            assert taken is not None, version
            stored, _ = two_store.load(version)
            for name, tensor in stored.items():
                bits = taken.tensors()[name].view(torch.int16)
                assert torch.equal(bits, tensor.view(torch.int16)), name
    finally:
        shutil.rmtree(slots, ignore_errors=True)


def _flaky_uploads(monkeypatch, fails) -> None:
    write_share = WeightWriter.write_share
    calls: list[int] = []

    def flaky(self, version, *args, **kwargs):
        calls.append(version)
        if fails(version, calls.count(version)):
            raise OSError(f"injected: the bucket refused v{version}'s upload")
        return write_share(self, version, *args, **kwargs)

    monkeypatch.setattr(WeightWriter, "write_share", flaky)


def test_a_failed_upload_is_retried_with_the_same_bytes(tmp_path, monkeypatch):
    _flaky_uploads(monkeypatch, lambda version, call: version == 2 and call == 1)
    with Topology.from_env("cpu") as topology:
        metrics = worker.publish_versions(str(tmp_path), topology)
    store = WeightStore(open_location(str(tmp_path)))
    assert store.versions() == [1, 2, 3]
    assert store.read_manifest(2).base == 1  # the retry is the same delta
    store.load(3)  # every piece verified
    assert metrics[2]["weights/publish_retries_total"] == 1.0  # reported by the next publish


def test_a_version_that_cannot_be_committed_fails_the_next_publish(tmp_path, monkeypatch):
    _flaky_uploads(monkeypatch, lambda version, call: version == 2)
    with Topology.from_env("cpu") as topology, pytest.raises(PublishFailedError) as failed:
        worker.publish_versions(str(tmp_path), topology)
    assert "weights v2 could not be committed" in str(failed.value)
    assert "the bucket refused v2's upload" in str(failed.value)
    store = WeightStore(open_location(str(tmp_path)))
    assert store.versions() == [1]
    assert store.latest_version() == 1


def test_a_rank_whose_share_landed_despite_an_error_moves_its_delta_base_with_rank_0(tmp_path):
    """Rank 1 sees its v2 share fail although it landed; rank 0 commits v2. Rank 1 must still
    take v2 as the base of the v3 delta, or v3 (and every delta after it) is corrupt."""
    resolve_model_path(worker.MODEL)
    torchrun(worker.__file__, f"--out={tmp_path}", "--land-then-fail")
    store = WeightStore(open_location(str(tmp_path)))
    assert store.versions() == [1, 2, 3]
    assert store.read_manifest(3).base == 2
    store.load(3)  # raises WeightIntegrityError if a piece was rebuilt on the wrong base
