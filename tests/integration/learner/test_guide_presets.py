"""The framework guide's remaining presets (`t1`, `vc_ppo`, `orz`) each train a short run on
the tiny model: a learner over a written stream takes its steps, publishes its versions and
logs what the preset is made of (an EMA reference's KL and the entropy bonus for T1; value
pre-training and the critic for VC-PPO; the critic without pre-training for ORZ)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from storage.fs import open_location
from storage.stream.writer import StreamWriter
from storage.weights.versions import WeightStore
from streamrl.config.loading import load_config
from streamrl.learner.loop import Learner
from streamrl.learner.topology import Topology
from tests.stream_data import random_group


@pytest.fixture(scope="module")
def topology():
    topo = Topology.from_env("cpu")
    yield topo
    topo.destroy()


def _write_stream(run_dir, groups: int = 40) -> None:
    rng = np.random.default_rng(0)
    writer = StreamWriter(open_location(str(run_dir)), "gen0")
    made = [
        random_group(rng, prompt_id=f"p{i}", vocab=600, max_len=24, prompt_len=10)
        for i in range(groups)
    ]
    for start in range(0, groups, 5):
        writer.write(made[start : start + 5])


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        ("t1", {"actor/kl_loss", "actor/ref_kl", "actor/entropy"}),
        ("vc_ppo", {"critic/vf_loss", "critic/explained_var"}),
        ("orz", {"critic/vf_loss", "critic/explained_var"}),
    ],
)
def test_a_guide_preset_trains_a_short_run(tmp_path, topology, preset, expected):
    run_dir = tmp_path / "run"
    _write_stream(run_dir)
    config = load_config(
        [preset, "tiny-cpu"],
        overrides=[
            f"storage.run_uri={run_dir}",
            "learner.total_steps=2",
            "learner.batch_groups=4",
            "learner.mini_batch_groups=2",
            "learner.checkpoint_every=100",
            "learner.max_staleness=100",  # the written stream is all version 0
            "generator.max_tokens=24",
            *(["algorithm.value_pretrain_steps=2"] if preset == "vc_ppo" else []),
        ],
    )
    run = open_location(str(run_dir))
    learner = Learner(config, run, topology)
    assert learner.run() == 2
    assert WeightStore(run).versions() == [1, 2]
    records = [json.loads(x) for x in (run_dir / "metrics/learner.jsonl").read_text().splitlines()]
    pretraining = [r for r in records if "value_pretrain_step" in r]
    assert len(pretraining) == (2 if preset == "vc_ppo" else 0)
    steps = [r for r in records if "value_pretrain_step" not in r]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        assert expected <= record.keys()
        assert all(np.isfinite(record[k]) for k in expected)
    if preset == "t1":
        assert steps[1]["actor/kl_loss"] > 0  # the policy moved from its EMA reference
