"""Every algorithm option (the off-policy correction menu, the policy losses, the framework
guide's advantage variants; `options_worker.OPTIONS`) trains
exactly alike — update (SGD at lr 1: the gradient) and every metric within 1e-5 — whatever
the micro-batch budget, and on 2 gloo ranks as on one: batch-normalised weights, response-level
rejection and the mismatch metrics' means and extremes are global, not per micro-batch or
rank."""

from __future__ import annotations

import json

import pytest
import torch

from streamrl.learner.topology import Topology
from streamrl.models import resolve_model_path
from tests.integration.learner import options_worker as worker
from tests.integration.learner.shared_prompt_worker import compare
from tests.integration.torchrun import torchrun


@pytest.fixture(scope="module")
def topology():
    topo = Topology.from_env("cpu")
    yield topo
    topo.destroy()


@pytest.fixture(scope="module")
def one_rank(topology) -> dict[str, tuple[list, dict]]:
    """Each option's update on one rank, the batch in one micro-batch."""
    return {
        option: worker.one_update(option, budget=4096, topology=topology)
        for option in worker.OPTIONS
    }


@pytest.mark.parametrize("option", list(worker.OPTIONS))
def test_an_option_trains_alike_whatever_the_micro_batch_budget(topology, one_rank, option):
    split = worker.one_update(option, budget=80, topology=topology)
    check = compare(one_rank[option], split)
    assert check["max_update_diff"] <= 1e-5, check
    assert check["max_update"] > 0, check
    assert check["metric_mismatches"] == [], check


def test_the_correction_acts_and_its_metrics_are_logged(one_rank):
    """The batch exercises what the options do: weights truncated, tokens and responses
    rejected and vetoed, a fresh-group KL above 0, ratios on both sides of 1."""
    metrics = {option: metrics for option, (_, metrics) in one_rank.items()}
    band = metrics["token-band-veto-normalised-one-update"]
    assert 0 < band["mismatch/rs_token_frac"] < 1
    assert 0 < band["mismatch/veto_frac"] < 1
    assert 0 < metrics["geometric-band"]["mismatch/rs_seq_frac"] < 1
    assert 0 < metrics["icepop"]["mismatch/rs_token_frac"] < 1
    assert metrics["tis-sequence-normalised"]["actor/is_clip_frac"] > 0
    for option, values in metrics.items():  # the weight applied: normalised, it averages 1
        if "normalised" in option:
            assert values["actor/is_weight_mean"] == pytest.approx(1.0, abs=1e-5), option
        else:
            assert values["actor/is_weight_mean"] != pytest.approx(values["mismatch/ratio_mean"])
    for values in metrics.values():
        assert values["mismatch/kl_k3_fresh"] > 0
        assert values["mismatch/ratio_min"] < 1 < values["mismatch/ratio_max"]
        assert values["mismatch/seq_ratio_max"] >= 1


@pytest.mark.parametrize(
    ("variant", "as_is"),
    [
        ("rank-advantage", "grpo-as-is"),
        ("confidence-baseline-length-reweight", "dapo-as-is"),
        ("inv-sqrt-len-baseline", "dr_grpo-as-is"),
        ("hierarchical-advantage", "dr_grpo-as-is"),
        ("temporal-groups", "grpo-as-is"),
        ("value-prior", "vapo-as-is"),
        ("length-reweight", "grpo-as-is"),
        ("icepop-veto", "icepop"),
        ("tis-token-normalised", "dapo-as-is"),
        ("no-correction", "dapo-as-is"),
        ("vc_ppo-as-is", "orz-as-is"),
        ("gspo", "grpo-as-is"),
        ("gspo_token-vapo", "vapo-as-is"),
        ("sapo-veto-normalised", "grpo-as-is"),
        ("cispo-band", "grpo-as-is"),
        ("opd-dapo", "dapo-as-is"),
        ("opd-pure", "grpo-as-is"),
    ],
)
def test_a_variant_changes_the_update(one_rank, variant, as_is):
    check = compare(one_rank[variant], one_rank[as_is])
    assert check["max_update_diff"] > 1e-4 * check["max_update"], check


def test_every_option_trains_alike_on_two_ranks(tmp_path, one_rank):
    resolve_model_path("tiny-qwen2")  # build the bundled model once, before two ranks race
    torchrun(worker.__file__, f"--out={tmp_path}", *worker.OPTIONS)
    results = json.loads((tmp_path / "rank0.json").read_text())
    for option, got in results.items():
        sharded = ([torch.tensor(u) for u in got["updates"]], got["metrics"])
        check = compare(one_rank[option], sharded)
        assert check["max_update_diff"] <= 1e-5, (option, check)
        assert check["metric_mismatches"] == [], (option, check)
