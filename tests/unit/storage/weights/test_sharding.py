"""A weight version published by two learner processes, each writing its FSDP2 shard of every
tensor (`write_share`) while rank 0 `commit`s, on a local folder and on SeaweedFS: the same
tensors and checksums as a one-process publish; a rank that fails or never writes abandons it."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from storage.fs import open_location
from storage.weights.publish import PublishAbandonedError, WeightWriter
from storage.weights.shares import TensorShare
from storage.weights.versions import WeightStore, WeightVersionNotFoundError
from tests.unit.storage.weights.test_versions import (
    REPO_ROOT,
    _assert_exact,
    _path,
    _state_dict,
    _xxh3,
)


def _rank_shares(state: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, TensorShare]:
    """FSDP2's split: dim-0 rows in `world` chunks (torch.chunk), rank `rank`'s chunk flattened
    (a 0-d tensor is one row); a rank past the last chunk holds an empty piece."""
    shares = {}
    for name, tensor in state.items():
        chunks = torch.chunk(tensor.reshape(1) if tensor.dim() == 0 else tensor, world)
        start = sum(chunk.numel() for chunk in chunks[:rank])
        data = chunks[rank].reshape(-1).clone() if rank < len(chunks) else tensor.new_empty(0)
        shares[name] = TensorShare(data, start, tuple(tensor.shape))
    return shares


_RANK_1 = """
import json, sys
import safetensors.torch
from storage.fs import open_location
from storage.weights.shares import TensorShare
from storage.weights.publish import WeightWriter
uri, options = json.loads(sys.stdin.readline())
writer = WeightWriter(open_location(uri, storage_options=options))
print("ready", flush=True)

def shares(path):
    tensors, starts = safetensors.torch.load_file(path), json.loads(open(path + ".json").read())
    return {name: TensorShare(tensors[name], *starts[name]) for name in starts}

for line in sys.stdin:  # one job a line: write rank 1's share of a version, say how many files
    job = json.loads(line)
    base = None
    if job["base"] is not None:
        base = (job["base"], {name: s.data for name, s in shares(job["base_file"]).items()})
    part = writer.write_share(job["version"], shares(job["file"]), publish_id=job["publish_id"],
                              rank=1, world=2, base=base)
    print(len(part.files), flush=True)
"""


def _save_shares(shares: dict[str, TensorShare], path: Path) -> str:
    safetensors.torch.save_file({name: share.data for name, share in shares.items()}, path)
    starts = {name: [share.start, list(share.shape)] for name, share in shares.items()}
    Path(f"{path}.json").write_text(json.dumps(starts))
    return str(path)


def test_two_ranks_publish_exactly_what_one_rank_publishes(run_uri_and_options, tmp_path):
    """Rank 1 is another process. v1 (full): both ranks write at once. v2 (a delta on v1):
    rank 1 writes only after rank 0 is waiting in `commit`."""
    uri, options = run_uri_and_options
    location = open_location(uri, storage_options=options)
    writer, store = WeightWriter(location), WeightStore(location)
    single_location = open_location(f"{uri}-single", storage_options=options)
    single_writer, single = WeightWriter(single_location), WeightStore(single_location)
    states = {1: _state_dict(1), 2: _state_dict(1)}
    states[2]["embed.weight"][5] += 1.0
    states[2]["head.bias"][0, 2] = 9.0  # the one-row tensor: rank 0's piece only
    states[2]["layers.0.mlp.weight"][-1] = 0.5  # rows of rank 1 only
    shares = {v: [_rank_shares(s, rank, 2) for rank in range(2)] for v, s in states.items()}
    jobs = {
        v: {
            "version": v,
            "publish_id": f"pub{v}",
            "file": _save_shares(shares[v][1], tmp_path / f"v{v}.safetensors"),
            "base": None if v == 1 else 1,
            "base_file": str(tmp_path / "v1.safetensors"),
        }
        for v in (1, 2)
    }

    with open(tmp_path / "stderr.txt", "wb") as stderr:
        rank_1 = subprocess.Popen(
            [sys.executable, "-c", _RANK_1],
            cwd=REPO_ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )

    def send(job):
        rank_1.stdin.write(json.dumps(job) + "\n")
        rank_1.stdin.flush()

    try:
        send([uri, options])  # keys never on argv
        assert rank_1.stdout.readline().strip() == "ready", (tmp_path / "stderr.txt").read_text()
        send(jobs[1])  # both ranks write now
        writer.write_share(1, shares[1][0], publish_id="pub1", rank=0, world=2)
        writer.commit(1, publish_id="pub1", world=2, timeout_s=60)
        assert rank_1.stdout.readline().strip() == "1", (tmp_path / "stderr.txt").read_text()

        base = (1, {name: share.data for name, share in shares[1][0].items()})
        writer.write_share(2, shares[2][0], publish_id="pub2", rank=0, world=2, base=base)
        threading.Timer(0.5, send, [jobs[2]]).start()
        started = time.monotonic()
        manifest = writer.commit(2, publish_id="pub2", world=2, timeout_s=60)
        assert time.monotonic() - started >= 0.5  # rank 0 waited for rank 1
        assert rank_1.stdout.readline().strip() == "1", (tmp_path / "stderr.txt").read_text()
    finally:
        rank_1.kill()
        rank_1.wait(timeout=30)

    assert manifest.base == 1
    assert (store.versions(), store.latest_version()) == ([1, 2], 2)
    single_writer.publish(1, states[1])
    single_writer.publish(2, states[2], base=(1, states[1]))
    for version, state in states.items():
        sharded, one = store.read_manifest(version), single.read_manifest(version)
        tensors = store.load(version)[0]
        _assert_exact(tensors, state)
        _assert_exact(tensors, single.load(version)[0])
        assert len(sharded.files) == 2  # one file per rank
        for name, tensor in state.items():
            entry, flat = sharded.tensors[name], tensor.reshape(-1)
            ranks = [shares[version][rank][name] for rank in range(2)]
            assert [(p.start, p.stop) for p in entry.pieces] == [
                (s.start, s.start + s.data.numel()) for s in ranks if s.data.numel()
            ]
            for piece in entry.pieces:
                assert piece.checksum == _xxh3(flat[piece.start : piece.stop])
            assert [p.checksum for p in one.tensors[name].pieces] == (
                [_xxh3(tensors[name])] if tensor.numel() else []
            )
    assert [p.encoding for p in manifest.tensors["embed.weight"].pieces] == ["delta", "delta"]


@pytest.mark.parametrize("failure", ["error", "never"])
def test_a_rank_that_fails_or_never_writes_abandons_the_version(run_location, failure):
    writer, store = WeightWriter(run_location), WeightStore(run_location)
    writer.publish(1, _state_dict(0))
    state = _state_dict(1)
    writer.write_share(2, _rank_shares(state, 0, 2), publish_id="p", rank=0, world=2)
    if failure == "error":
        writer.abandon_share(2, publish_id="p", rank=1, world=2, error="CUDA out of memory")
        match = "rank 1: CUDA out of memory"
    else:
        match = r"no part from 1 rank\(s\) after 0s \(p-part-00001-of-00002.json\)"
    started = time.monotonic()
    with pytest.raises(PublishAbandonedError, match=match):
        writer.commit(2, publish_id="p", world=2, timeout_s=0.3)
    assert time.monotonic() - started < 5
    assert (store.versions(), store.latest_version()) == ([1], 1)
    assert not run_location.fs.exists(_path(run_location, 2, "manifest.json"))
    with pytest.raises(WeightVersionNotFoundError):
        store.load(2)

    writer.publish(3, state)  # the next version commits; the abandoned folder is a dead publish
    assert writer.retain(keep=5) == [2]
    _assert_exact(store.load()[0], state)


def test_an_error_part_ends_the_wait_while_another_rank_is_still_missing(run_location):
    writer, store = WeightWriter(run_location), WeightStore(run_location)
    state = _state_dict(0)
    writer.write_share(1, _rank_shares(state, 0, 3), publish_id="p", rank=0, world=3)
    writer.abandon_share(1, publish_id="p", rank=1, world=3, error="disk full")
    started = time.monotonic()  # rank 2 never writes; the error alone must end the wait
    with pytest.raises(PublishAbandonedError, match="rank 1: disk full"):
        writer.commit(1, publish_id="p", world=3, timeout_s=60)
    assert time.monotonic() - started < 10
    assert store.versions() == []
