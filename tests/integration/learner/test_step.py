"""The learner's loss step on the tiny model, one process: exact micro-batch accumulation and
the end-to-end update."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamrl.algorithms import broadcast_to_tokens, grpo_advantages
from streamrl.config.loading import load_config
from streamrl.learner.mini_batches import TrainBatch, make_mini_batches
from streamrl.learner.model import load_policy
from streamrl.learner.objective import policy_loss
from streamrl.learner.optim import build_optimizer
from streamrl.learner.scoring import MicroTargets
from streamrl.learner.step import StepModels, StepSettings, Trainable, train_on_batch
from streamrl.learner.topology import Topology
from tests.stream_data import random_group

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def topology():
    topo = Topology.from_env("cpu")
    yield topo
    topo.destroy()


def _config(algorithm: str):
    overrides = [f"generator.max_tokens={MAX_TOKENS}"]
    if algorithm == "grpo":
        overrides.append("algorithm.kl=null")
    return load_config([algorithm, "tiny-cpu"], overrides=overrides)


def _batch(vocab: int, groups: int = 4, seed: int = 0) -> TrainBatch:
    rng = np.random.default_rng(seed)
    return TrainBatch.from_groups(
        [
            random_group(rng, prompt_id=f"p{i}", vocab=vocab, max_len=MAX_TOKENS, prompt_len=10)
            for i in range(groups)
        ]
    )


def _gradients(model, batch, config, budget: int) -> tuple[list[torch.Tensor], float]:
    (mini,) = make_mini_batches(batch, batch.num_groups, budget)
    settings = StepSettings(temperature=1.0, max_response_len=MAX_TOKENS)
    rewards = torch.as_tensor(batch.rewards)
    groups = torch.as_tensor(batch.group_index)
    advantages = grpo_advantages(rewards, groups, batch.num_groups)
    model.zero_grad(set_to_none=True)
    total = 0.0
    for micro in mini.micro_batches:
        targets = MicroTargets(broadcast_to_tokens(advantages[micro.sample_index], micro.loss_mask))
        loss, _ = policy_loss(model, micro, mini, targets, config.algorithm, settings)
        loss.backward()
        total += float(loss)
    return [p.grad.detach().clone() for p in model.parameters()], total


@pytest.mark.parametrize("algorithm", ["dapo", "grpo", "dr_grpo"])
def test_micro_batch_budget_leaves_loss_and_gradient_unchanged(algorithm):
    config = _config(algorithm)
    model = load_policy("tiny-qwen2", config.model)
    batch = _batch(model.config.vocab_size)
    whole, whole_loss = _gradients(model, batch, config, budget=4096)
    split, split_loss = _gradients(model, batch, config, budget=80)
    (mini,) = make_mini_batches(batch, batch.num_groups, 80)
    assert len(mini.micro_batches) > 3  # the small budget really splits the batch
    assert split_loss == pytest.approx(whole_loss, abs=1e-6)
    for a, b in zip(whole, split, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_train_on_batch_updates_parameters_and_reports_metrics(topology):
    config = _config("dapo")
    model = load_policy("tiny-qwen2", config.model)
    before = [p.detach().clone() for p in model.parameters()]
    batch = _batch(model.config.vocab_size, groups=4, seed=3)
    mini_batches = make_mini_batches(batch, 2, 256)  # two updates: proximal log-probs needed
    optimizer = build_optimizer(model.parameters(), lr=1e-3, weight_decay=0.0)
    settings = StepSettings(temperature=1.0, max_response_len=MAX_TOKENS, grad_clip=1.0)
    models = StepModels(Trainable(model, optimizer))
    metrics = train_on_batch(models, batch, mini_batches, config.algorithm, settings, topology)
    for name in ("actor/pg_loss", "actor/entropy", "actor/clip_frac", "actor/ppo_kl",
                 "actor/is_weight_mean", "actor/is_clip_frac", "actor/grad_norm"):  # fmt: skip
        assert np.isfinite(metrics[name]), name
    assert metrics["actor/grad_norm"] > 0
    assert metrics["actor/entropy"] > 0
    # The second update sees ratios ≠ 1 against the proximal (start-of-step) weights.
    assert metrics["actor/ppo_kl"] != 0.0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
