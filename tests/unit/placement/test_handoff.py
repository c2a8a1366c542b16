"""The device-local weight hand-off (`streamrl.placement.handoff`) on CPU: the learner's slots in
shared memory, read by another process, taken only for the committed publish, and a load that
the learner overwrote meanwhile detected (the engine then reads storage)."""

from __future__ import annotations

import dataclasses
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from storage.fs import open_location
from storage.weights.publish import WeightWriter
from storage.weights.shares import TensorShare, new_publish_id
from storage.weights.versions import WeightStore
from streamrl.generator.weight_worker import (
    WeightReloadExtension,
    WeightSource,
    take_handed_off,
)
from streamrl.placement.handoff import HandOffReader, HandOffWriter, handoff_dir

CPU = torch.device("cpu")


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(10, 6, generator=g),
        "layer.bias": torch.randn(7, generator=g),
        "steps": torch.tensor([seed], dtype=torch.int64),
    }


def _shares(state, ranks: int = 1, rank: int = 0):
    """Rank `rank`'s pieces: dim-0 row ranges, as FSDP2 shards them (the int tensor whole on
    rank 0)."""
    out = {}
    for name, value in state.items():
        if value.dim() == 0 or value.dtype == torch.int64:
            out[name] = (value if rank == 0 else value.new_empty(0), 0, tuple(value.shape))
            continue
        rows = -(-value.shape[0] // ranks)
        local = value[rank * rows : (rank + 1) * rows]
        start = rank * rows * (value.numel() // value.shape[0])
        out[name] = (local, start if local.numel() else 0, tuple(value.shape))
    return out


def _commit(writer: WeightWriter, version: int, publish_id: str, state, ranks: int = 1, dtype=None):
    """Commit `version` to the store as the learner does: each rank's share, then the manifest."""
    for rank in range(ranks):
        shares = {}
        for name, (local, start, shape) in _shares(state, ranks, rank).items():
            data = local.reshape(-1)
            if dtype is not None and data.is_floating_point():
                data = data.to(dtype)
            shares[name] = TensorShare(data.clone(), start, shape)
        writer.write_share(version, shares, publish_id=publish_id, rank=rank, world=ranks)
    return writer.commit(version, publish_id=publish_id, world=ranks)


@pytest.fixture
def run(tmp_path: Path):
    location = open_location(str(tmp_path / "run"))
    location.fs.makedirs(location.path, exist_ok=True)
    directory = handoff_dir(location.uri)
    yield location, WeightWriter(location), directory
    import shutil

    shutil.rmtree(directory, ignore_errors=True)


def test_a_committed_version_is_taken_whole_and_bit_exact(run) -> None:
    location, store, directory = run
    publish_id = new_publish_id()
    state = _state(1)
    writer = HandOffWriter(directory, 0, 1, CPU)
    writer.write(1, publish_id, _shares(state), torch.bfloat16)
    manifest = _commit(store, 1, publish_id, state, dtype=torch.bfloat16)

    taken = HandOffReader(directory).take(manifest, CPU)
    assert taken is not None
    assert taken.version == 1
    from_storage, _ = WeightStore(location).load(1)
    assert set(taken.tensors()) == set(from_storage)
    for name, tensor in from_storage.items():
        got = taken.tensors()[name]
        assert got.dtype == tensor.dtype
        assert got.shape == tensor.shape
        assert torch.equal(got, tensor), name
    assert taken.intact()
    # Only the run's user may open the slots.
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700


def test_another_process_reads_the_learners_slot(run) -> None:
    location, store, directory = run
    publish_id = new_publish_id()
    state = _state(2)
    writer = HandOffWriter(directory, 0, 1, CPU)
    writer.write(3, publish_id, _shares(state), torch.float32)
    _commit(store, 3, publish_id, state)
    script = textwrap.dedent(
        f"""
        import torch
        from storage.fs import open_location
        from storage.weights.versions import WeightStore
        from streamrl.generator.weight_worker import take_handed_off
        from streamrl.placement.handoff import HandOffReader, handoff_dir
        store = WeightStore(open_location({location.uri!r}))
        reader = HandOffReader(handoff_dir({location.uri!r}))
        taken = take_handed_off(reader, store, 0, [], None, torch.device("cpu"))
        print(taken.version, float(taken.tensors()["embed.weight"].sum()))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    assert out == ["3", str(float(state["embed.weight"].sum()))]


def test_only_the_committed_publish_is_taken(run) -> None:
    location, store, directory = run
    state = _state(3)
    manifest = _commit(store, 1, new_publish_id(), state)
    reader = HandOffReader(directory)
    assert reader.take(manifest, CPU) is None  # no slot at all

    # A slot of another learner life (publish id) holding the same version number.
    HandOffWriter(directory, 0, 1, CPU).write(1, new_publish_id(), _shares(state), torch.float32)
    assert reader.take(manifest, CPU) is None

    # The right publish, but another dtype or shape than the manifest names.
    publish_id = new_publish_id()
    writer = HandOffWriter(directory, 0, 1, CPU)
    writer.write(2, publish_id, _shares(state), torch.bfloat16)
    manifest2 = _commit(store, 2, publish_id, state)  # stored in float32
    assert reader.take(manifest2, CPU) is None

    # Uncommitted: the newest committed version is taken from storage, not from a newer slot.
    writer.write(4, publish_id, _shares(_state(4)), torch.float32)
    assert take_handed_off(reader, WeightStore(location), 0, [], None, CPU) is None


def test_a_load_the_learner_overwrote_is_detected(run) -> None:
    _, store, directory = run
    publish_id = new_publish_id()
    writer = HandOffWriter(directory, 0, 1, CPU)
    writer.write(1, publish_id, _shares(_state(1)), torch.float32)
    manifest = _commit(store, 1, publish_id, _state(1))
    taken = HandOffReader(directory).take(manifest, CPU)
    assert taken is not None

    writer.write(2, publish_id, _shares(_state(2)), torch.float32)  # the other slot
    assert taken.intact()
    expected = _state(1)["embed.weight"]
    assert torch.equal(taken.tensors()["embed.weight"], expected)

    writer.write(3, publish_id, _shares(_state(3)), torch.float32)  # version 1's slot
    assert not taken.intact()

    writer.close()
    assert not list(directory.glob("rank*")), "a closed writer leaves no slot behind"


def test_the_shards_of_several_ranks_are_put_together(run) -> None:
    _location, store, directory = run
    publish_id = new_publish_id()
    state = _state(5)
    for rank in range(3):
        writer = HandOffWriter(directory, rank, 3, CPU)
        writer.write(1, publish_id, _shares(state, 3, rank), torch.float32)
    manifest = _commit(store, 1, publish_id, state, ranks=3)
    taken = HandOffReader(directory).take(manifest, CPU)
    assert taken is not None
    for name, tensor in state.items():
        assert torch.equal(taken.tensors()[name], tensor), name

    # One rank's slot still being written: nothing is taken.
    HandOffWriter(directory, 2, 3, CPU).write(3, publish_id, _shares(state, 3, 2), torch.float32)
    assert HandOffReader(directory).take(manifest, CPU) is None


class _Runner:
    """Stands in for vLLM's model runner (the race below cannot be timed inside a real one):
    records what each load gave it, and lets the learner publish in the middle of the first."""

    def __init__(self, during_load=None) -> None:
        self.loads: list[dict[str, torch.Tensor]] = []
        self.during_load = during_load

    def reload_weights(self, weights_iterator) -> None:
        self.loads.append({name: tensor.clone() for name, tensor in weights_iterator})
        if self.during_load is not None:
            self.during_load()
            self.during_load = None

    def get_model(self) -> torch.nn.Module:
        return torch.nn.Module()


class _Worker(WeightReloadExtension):
    device = CPU

    def __init__(self, runner: _Runner) -> None:
        self.model_runner = runner


def test_a_torn_load_is_replaced_by_the_version_from_storage_before_the_engine_resumes(run):
    location, store, directory = run
    publish_id = new_publish_id()
    writer = HandOffWriter(directory, 0, 1, CPU)
    writer.write(1, publish_id, _shares(_state(1)), torch.float32)
    _commit(store, 1, publish_id, _state(1))
    source = dataclasses.asdict(WeightSource(location.uri, hold=False, handoff=True))

    whole = _Worker(_Runner())
    assert whole.prepare_streamrl_weights(source, 0, [], None)["version"] == 1
    assert whole.apply_streamrl_weights() == "handoff"
    assert torch.equal(whole.model_runner.loads[0]["embed.weight"], _state(1)["embed.weight"])

    # The learner publishes v3 into v1's slot while the engine copies v1 out of it.
    torn = _Worker(_Runner(lambda: writer.write(3, publish_id, _shares(_state(3)), torch.float32)))
    assert torn.prepare_streamrl_weights(source, 0, [], None)["version"] == 1
    assert torn.apply_streamrl_weights() == "storage"
    _, again = torn.model_runner.loads  # loaded a second time, from storage
    assert torch.equal(again["embed.weight"], _state(1)["embed.weight"])


def test_slots_that_cannot_be_had_turn_the_handoff_off_without_failing_the_learner(run):
    """Shared memory short (a container's small /dev/shm): the slots are reserved up front, so
    the learner gets a warning and storage instead of a SIGBUS in the middle of a write."""
    _, _, directory = run
    script = textwrap.dedent(
        f"""
        import logging, resource, signal, sys, torch
        from pathlib import Path
        from streamrl.placement.handoff import HandOffWriter
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # files past 4 KiB: refused
        writer = HandOffWriter(Path({str(directory)!r}), 0, 1, torch.device("cpu"))
        shares = {{"w": (torch.ones(100_000), 0, (100_000,))}}
        print(writer.write(1, "abc", shares, torch.float32), writer.off)
        print(writer.write(2, "abc", shares, torch.float32))
        print(sorted(p.name for p in Path({str(directory)!r}).iterdir()))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "the weight hand-off is off for this learner life" in done.stdout
    assert "--shm-size" in done.stdout
    assert lines[-3:] == ["None True", "None", "[]"]  # said once, nothing left behind
    assert done.stdout.count("hand-off is off") == 1


def test_the_slots_of_a_learner_that_died_are_not_taken(run):
    """On CUDA a dead learner's memory is gone whatever its header says: a committed version
    whose writer no longer runs is read from storage."""
    _, store, directory = run
    publish_id = new_publish_id()
    script = textwrap.dedent(
        f"""
        import torch
        from pathlib import Path
        from tests.unit.placement.test_handoff import _shares, _state
        from streamrl.placement.handoff import HandOffWriter
        writer = HandOffWriter(Path({str(directory)!r}), 0, 1, torch.device("cpu"))
        writer.write(1, {publish_id!r}, _shares(_state(1)), torch.float32)
        """
    )  # the learner writes its slot, then dies without closing it
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    manifest = _commit(store, 1, publish_id, _state(1))
    assert (directory / "rank00000-slot1.json").exists()
    assert HandOffReader(directory).take(manifest, CPU) is None
