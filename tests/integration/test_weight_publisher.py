"""The learner's publisher on real ranks: two gloo ranks each writing their FSDP2 shards
publish exactly what one rank publishes (full and delta versions, bf16); a failed upload
leaves LATEST on the last complete version, training goes on, and the next version is full."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from storage.fs import open_location
from storage.weights import WeightStore
from streamrl.learner.topology import Topology
from streamrl.models import resolve_model_path
from tests.integration import publish_worker as worker
from tests.integration.torchrun import torchrun


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("one-rank")
    with Topology.from_env("cpu") as topology:
        worker.publish_versions(str(run), topology)
    return run


def test_two_ranks_publish_exactly_what_one_rank_publishes(one_rank_run, tmp_path):
    resolve_model_path(worker.MODEL)  # built once, before two ranks race to build it
    two = tmp_path / "two-ranks"
    torchrun(worker.__file__, f"--out={two}")
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


def test_a_failed_upload_is_not_committed_and_the_next_version_is_full(tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    write_share = WeightStore.write_share

    def flaky(self, version, *args, **kwargs):
        if version == 2:
            raise OSError("injected: the bucket refused the upload")
        return write_share(self, version, *args, **kwargs)

    monkeypatch.setattr(WeightStore, "write_share", flaky)
    with Topology.from_env("cpu") as topology:
        metrics = worker.publish_versions(run, topology)
    store = WeightStore(open_location(run))
    assert store.versions() == [1, 3]
    assert store.latest_version() == 3
    assert store.read_manifest(3).is_full  # its base (2) was never committed
    assert metrics[2]["weights/publish_failures_total"] == 1.0  # reported by the next publish
    assert not list((tmp_path / "run" / "weights" / "v00000002").glob("*.safetensors"))
