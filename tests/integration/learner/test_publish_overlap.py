"""Background publishing never changes the learner's arithmetic: a learner whose uploads
overlap its training steps on a machine whose cores are all busy ends with weights bit-identical
to one that publishes in the foreground (no overlap)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from storage.fs import open_location
from storage.stream.writer import StreamWriter
from streamrl.config.loading import load_config
from streamrl.learner.loop import Learner
from streamrl.learner.topology import Topology
from tests.load import busy_loops
from tests.stream_data import random_group

STEPS = 6


@pytest.fixture(scope="module")
def topology():
    topo = Topology.from_env("cpu")
    yield topo
    topo.destroy()


@pytest.fixture
def busy_cores():
    """One spinning process per core, for the whole test."""
    with busy_loops(torch.get_num_threads()):
        yield


def _train(run_dir, topology: Topology, background: bool) -> dict[str, torch.Tensor]:
    rng, run = np.random.default_rng(0), open_location(str(run_dir))
    writer = StreamWriter(run, "gen0")
    for n in range(0, 4 * STEPS + 8, 4):
        writer.write(
            [random_group(rng, prompt_id=f"p{n + i}", vocab=600, max_len=24) for i in range(4)]
        )
    config = load_config(
        ["dapo", "tiny-cpu"],
        overrides=[
            f"storage.run_uri={run_dir}",
            f"learner.total_steps={STEPS}",
            "learner.batch_groups=4",
            "learner.mini_batch_groups=2",
            "learner.checkpoint_every=100",
            "learner.max_staleness=100",
            "learner.lr=1e-3",
            "weights.full_every=3",  # deltas too: the upload thread's torch work
            f"weights.background={str(background).lower()}",
            "generator.max_tokens=24",
        ],
    )
    learner = Learner(config, run, topology)
    learner.run()
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in learner.models.policy.model.state_dict().items()
    }


def test_background_publishing_under_contention_leaves_the_weights_bit_identical(
    tmp_path, topology, busy_cores
):
    threads = torch.get_num_threads()
    overlapped = _train(tmp_path / "background", topology, background=True)
    assert torch.get_num_threads() == threads  # the upload thread's own count stays its own
    foreground = _train(tmp_path / "foreground", topology, background=False)
    assert overlapped.keys() == foreground.keys()
    differing = [n for n in overlapped if not torch.equal(overlapped[n], foreground[n])]
    assert not differing, f"{len(differing)} tensors differ, e.g. {differing[:3]}"
