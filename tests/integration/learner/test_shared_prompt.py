"""The fast learner path — each group's prompt computed once (shared-prompt rows, block mask)
and the LM head only on response positions, chunked — against today's path (a row per
response, full logits), on the same batch from the same weights: every algorithm preset's
update (SGD at lr 1, so the update is the gradient), its loss and metrics agree within 1e-5 in
fp32, with token budgets that cut the groups differently, truncated and length-1 responses and a
group of one response. On 2 gloo ranks: tests/integration/learner/shared_prompt_worker.py."""

from __future__ import annotations

import json

import pytest
import torch

from streamrl.learner.config import LearnerConfig
from streamrl.learner.forward import (
    attention_implementation,
    set_attention,
    shares_prompts,
    token_scores,
    use_hidden_states_head,
)
from streamrl.learner.mini_batches import make_mini_batches
from streamrl.learner.model import load_policy
from streamrl.learner.topology import Topology
from streamrl.models import resolve_model_path
from tests.integration.learner import shared_prompt_worker as worker
from tests.integration.learner.shared_prompt_worker import (
    BUDGETS,
    PRESETS,
    batch_with_edge_cases,
    compare,
    config_for,
    one_update,
)
from tests.integration.torchrun import torchrun


@pytest.fixture(scope="module")
def topology():
    topo = Topology.from_env("cpu")
    yield topo
    topo.destroy()


@pytest.mark.parametrize("algorithm", PRESETS)
def test_the_fast_path_trains_exactly_as_todays_path(topology, algorithm):
    config = config_for(algorithm)
    for budget in BUDGETS:
        today = one_update(config, fast=False, budget=budget, topology=topology)
        fast = one_update(config, fast=True, budget=budget, topology=topology)
        check = compare(today, fast)
        assert check["max_update_diff"] <= 1e-5, (budget, check)
        assert check["max_update"] > 0, (budget, check)
        assert check["metric_mismatches"] == [], (budget, check)


def test_groups_share_a_row_when_they_fit_and_fall_back_when_they_do_not():
    config = config_for("dapo")
    batch = batch_with_edge_cases(1000)
    (whole,) = make_mini_batches(batch, batch.num_groups, 4096, shared_prompt=True)
    assert len(whole.micro_batches) == 1
    rows = whole.micro_batches[0].input_ids.shape[0]
    assert rows == batch.num_groups  # a row per group
    (tight,) = make_mini_batches(batch, batch.num_groups, 40, shared_prompt=True)
    shared = sum(m.input_ids.shape[0] for m in tight.micro_batches)
    assert batch.num_groups < shared <= len(batch.rewards)  # long groups: a row per response
    assert shares_prompts(load_policy("tiny-qwen2", config.model), "auto")
    eager = load_policy("tiny-qwen2", config.model)
    eager.config._attn_implementation = "eager"
    assert not shares_prompts(eager, "auto")
    with pytest.raises(ValueError, match=r"learner\.shared_prompt=on needs attention"):
        shares_prompts(eager, "on")


@pytest.mark.timeout(600)
def test_the_fast_path_trains_exactly_as_todays_path_on_two_ranks(tmp_path):
    resolve_model_path("tiny-qwen2")  # build the bundled model once, before two ranks race
    torchrun(worker.__file__, f"--out={tmp_path}", *PRESETS)
    results = json.loads((tmp_path / "rank0.json").read_text())
    assert sorted(results) == sorted(PRESETS)
    for algorithm, checks in results.items():
        for check in checks:
            assert check["max_update_diff"] <= 1e-5, (algorithm, check)
            assert check["max_update"] > 0, (algorithm, check)
            assert check["metric_mismatches"] == [], (algorithm, check)


def test_flex_attention_scores_shared_prompt_rows_as_sdpa_does():
    """The same rows through FlexAttention with a block mask (`learner.attention=flex_attention`)
    and through SDPA with the dense mask: the same log-probs and entropies (forward only: CPU
    has no FlexAttention backward; tests/gpu compares the gradients on CUDA)."""
    model = use_hidden_states_head(load_policy("tiny-qwen2", config_for("dapo").model)).eval()
    batch = batch_with_edge_cases(model.config.vocab_size)
    (mini,) = make_mini_batches(batch, batch.num_groups, 4096, shared_prompt=True)
    (micro,) = mini.micro_batches
    assert micro.segments is not None
    scores = {}
    with torch.no_grad():
        for implementation in ("sdpa", "flex_attention"):
            set_attention(model, implementation)
            scores[implementation] = token_scores(model, micro)
    for sdpa, flex in zip(scores["sdpa"], scores["flex_attention"], strict=True):
        assert sdpa[micro.sampled_mask].abs().sum() > 0
        torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)


def test_flex_attention_is_refused_off_cuda_naming_the_fix():
    with pytest.raises(ValueError, match=r"flex_attention needs learner\.device=cuda"):
        LearnerConfig(device="cpu", attention="flex_attention")
    with pytest.raises(ValueError, match=r"FlexAttention has no backward pass on cpu"):
        attention_implementation("flex_attention", torch.device("cpu"))
    assert attention_implementation("auto", torch.device("cpu")) == "sdpa"
