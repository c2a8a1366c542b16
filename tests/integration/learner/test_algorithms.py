"""The learner's critic and reference-policy algorithms on the tiny model, one process: VAPO
(value pre-training, GAE, value loss, positive-example NLL), REINFORCE++ (KL in the reward,
global whitening), KL in the loss against a frozen or EMA reference."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from streamrl.config.loading import load_config
from streamrl.learner.mini_batches import TrainBatch, make_mini_batches, shard_for_rank
from streamrl.learner.model import load_policy, load_value_model
from streamrl.learner.optim import build_optimizer
from streamrl.learner.scoring import score_batch
from streamrl.learner.step import StepModels, StepSettings, Trainable, train_on_batch
from streamrl.learner.topology import Topology
from tests.stream_data import random_group

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def topology():
    topo = Topology.from_env("cpu")
    yield topo
    topo.destroy()


def _config(algorithm: str, *overrides: str):
    extra = ["model.critic.init_from=policy"] if algorithm == "vapo" else []
    return load_config(
        [algorithm, "tiny-cpu"],
        overrides=[f"generator.max_tokens={MAX_TOKENS}", *extra, *overrides],
    )


def _batch(vocab: int, groups: int = 4, seed: int = 0) -> TrainBatch:
    """Random groups whose raw score says correct (1) exactly when the reward is +1."""
    rng = np.random.default_rng(seed)
    made = []
    for i in range(groups):
        group = random_group(rng, prompt_id=f"p{i}", vocab=vocab, max_len=MAX_TOKENS, prompt_len=10)
        group.raw_scores[:] = (group.rewards > 0).astype(np.float32)
        made.append(group)
    return TrainBatch.from_groups(made)


def _models(config, *, critic: bool = False, reference: bool = False, sgd: bool = False):
    """Policy (+ critic, + reference copy). With `sgd`, plain SGD at lr 1: Δθ = −gradient."""

    def optimizer(model, lr):
        if sgd:
            return torch.optim.SGD(model.parameters(), lr=1.0)
        return build_optimizer(model.parameters(), lr=lr, weight_decay=0.0)

    torch.manual_seed(0)
    policy = load_policy("tiny-qwen2", config.model)
    models = StepModels(Trainable(policy, optimizer(policy, 1e-3)))
    if critic:
        value = load_value_model("tiny-qwen2", config.model, seed=0)
        models.critic = Trainable(value, optimizer(value, 1e-3))
    if reference:
        models.reference = copy.deepcopy(policy).requires_grad_(False).eval()
    return models


def _settings() -> StepSettings:
    return StepSettings(temperature=1.0, max_response_len=MAX_TOKENS, grad_clip=None)


def _params(module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


# -- exactness: the token budget changes nothing -------------------------------------------


@pytest.mark.parametrize(
    ("algorithm", "overrides"),
    [
        ("vapo", ()),
        ("reinforce_pp", ()),
        ("reinforce_pp", ("algorithm.baseline=true",)),
        ("grpo", ()),  # KL k3 in the loss against a frozen reference
    ],
)
def test_micro_batch_budget_leaves_every_update_unchanged(topology, algorithm, overrides):
    """With SGD at lr 1 the update is the gradient: policy and critic updates must not depend on
    how the batch is cut into micro-batches (global whitening, GAE and denominators)."""
    config = _config(algorithm, *overrides)
    updates = []
    for budget in (4096, 80):
        models = _models(
            config,
            critic=config.algorithm.uses_value_model,
            reference=algorithm in ("grpo", "reinforce_pp"),
            sgd=True,
        )
        # Perturb the reference so the KL terms are not zero.
        if models.reference is not None:
            with torch.no_grad():
                for p in models.reference.parameters():
                    p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        batch = _batch(models.policy.model.config.vocab_size)
        minis = make_mini_batches(batch, batch.num_groups, budget)
        if budget == 80:
            assert len(minis[0].micro_batches) > 3
        before = _params(models.policy.model) + (
            _params(models.critic.model) if models.critic else []
        )
        train_on_batch(models, batch, minis, config.algorithm, _settings(), topology)
        after = _params(models.policy.model) + (
            _params(models.critic.model) if models.critic else []
        )
        updates.append([a - b for a, b in zip(after, before, strict=True)])
    for whole, split in zip(*updates, strict=True):
        torch.testing.assert_close(whole, split, atol=1e-6, rtol=0)
    assert any(u.abs().max() > 0 for u in updates[0])


# -- REINFORCE++ ----------------------------------------------------------------------------


def _scored(models, config, topology, budget=80):
    batch = _batch(models.policy.model.config.vocab_size)
    minis = make_mini_batches(batch, 2, budget)
    micros = [shard_for_rank(m, 0, 1) for m in minis]
    scored, metrics = score_batch(
        models,
        batch.responses(minis),
        micros,
        config.algorithm,
        _settings(),
        topology,
        proximal=False,
    )
    pairs = [(t, m) for ts, ms in zip(scored, micros) for t, m in zip(ts, ms)]  # noqa: B905
    return batch, pairs, metrics


def test_reinforce_pp_advantages_are_whitened_over_the_whole_batch(topology):
    config = _config("reinforce_pp")
    models = _models(config, reference=True)
    _, pairs, metrics = _scored(models, config, topology)
    values = torch.cat([t.advantages[m.loss_mask] for t, m in pairs])
    assert float(values.mean()) == pytest.approx(0.0, abs=1e-5)
    assert float(values.std()) == pytest.approx(1.0, abs=1e-4)
    for t, m in pairs:  # nothing outside the loss tokens
        assert torch.all(t.advantages[~m.loss_mask] == 0)
    # The behaviour log-probs of the synthetic stream are far from the reference's.
    assert metrics["actor/ref_kl"] != 0.0


def test_reinforce_pp_returns_carry_the_kl_penalty_to_earlier_tokens(topology):
    """Before whitening, return_t = R − β·Σ_{k≥t} KL_k: the reward-to-go of the penalties."""
    config = _config("reinforce_pp", "algorithm.kl.coef=0.5")
    plain = _config("reinforce_pp", "algorithm.kl=null")
    models = _models(config, reference=True)
    _, with_kl, _ = _scored(models, config, topology)
    _, without_kl, _ = _scored(models, plain, topology)
    changed = [
        not torch.allclose(a.advantages, b.advantages)
        for (a, _), (b, _) in zip(with_kl, without_kl, strict=True)
    ]
    assert any(changed)


# -- KL in the loss, reference policies ----------------------------------------------------


def test_grpo_kl_loss_is_zero_against_an_identical_reference_then_grows(topology):
    config = _config("grpo")
    models = _models(config, reference=True)
    batch = _batch(models.policy.model.config.vocab_size)
    one = train_on_batch(
        models, batch, make_mini_batches(batch, 4, 4096), config.algorithm, _settings(), topology
    )
    assert one["actor/kl_loss"] == pytest.approx(0.0, abs=1e-7)  # policy == reference
    two = train_on_batch(
        models, batch, make_mini_batches(batch, 4, 4096), config.algorithm, _settings(), topology
    )
    assert two["actor/kl_loss"] > 1e-6  # the policy moved away from the frozen reference


def test_ema_reference_moves_toward_the_policy_after_each_step(topology):
    tau = 0.9
    config = _config("grpo", "algorithm.kl.reference=ema", f"algorithm.kl.ema_tau={tau}")
    models = _models(config, reference=True)
    start = _params(models.reference)
    batch = _batch(models.policy.model.config.vocab_size)
    train_on_batch(
        models, batch, make_mini_batches(batch, 4, 4096), config.algorithm, _settings(), topology
    )
    policy = _params(models.policy.model)
    for ref, r0, p in zip(models.reference.parameters(), start, policy, strict=True):
        torch.testing.assert_close(ref.detach(), tau * r0 + (1 - tau) * p, atol=1e-6, rtol=1e-6)
    assert any(
        not torch.equal(r.detach(), r0)
        for r, r0 in zip(models.reference.parameters(), start, strict=True)
    )


# -- VAPO -----------------------------------------------------------------------------------


def test_vapo_value_pretraining_lowers_the_value_loss_and_raises_explained_variance(topology):
    config = _config("vapo")
    models = _models(config, critic=True)
    policy_before = _params(models.policy.model)
    batch = _batch(models.policy.model.config.vocab_size, groups=4, seed=5)
    minis = make_mini_batches(batch, 4, 4096)
    history = [
        train_on_batch(
            models, batch, minis, config.algorithm, _settings(), topology, train_policy=False
        )
        for _ in range(25)
    ]
    loss = [h["critic/vf_loss"] for h in history]
    ev = [h["critic/explained_var"] for h in history]
    print(f"vf_loss {loss[0]:.4f} → {loss[-1]:.4f}; explained variance {ev[0]:.3f} → {ev[-1]:.3f}")
    assert loss[-1] < 0.5 * loss[0]
    assert ev[-1] > ev[0] + 0.3
    assert "actor/pg_loss" not in history[-1]  # the policy was not trained
    for a, b in zip(policy_before, models.policy.model.parameters(), strict=True):
        assert torch.equal(a, b.detach())


def test_vapo_step_trains_policy_and_critic_with_the_positive_example_loss(topology):
    config = _config("vapo")
    models = _models(config, critic=True)
    before = _params(models.policy.model), _params(models.critic.model)
    batch = _batch(models.policy.model.config.vocab_size)
    assert bool((batch.raw_scores >= 1).any())
    metrics = train_on_batch(
        models, batch, make_mini_batches(batch, 2, 256), config.algorithm, _settings(), topology
    )
    for name in ("actor/pg_loss", "actor/nll_loss", "critic/vf_loss", "critic/explained_var",
                 "critic/grad_norm", "actor/grad_norm"):  # fmt: skip
        assert np.isfinite(metrics[name]), name
    assert metrics["actor/nll_loss"] > 0  # −log p of correct responses' tokens
    after = _params(models.policy.model), _params(models.critic.model)
    for old, new in zip(before, after, strict=True):
        assert any(not torch.equal(a, b) for a, b in zip(old, new, strict=True))


def test_step_refuses_missing_models_naming_them(topology):
    batch = _batch(600)
    minis = make_mini_batches(batch, 4, 4096)
    vapo = _config("vapo")
    models = _models(vapo)
    with pytest.raises(ValueError, match="needs a critic"):
        train_on_batch(models, batch, minis, vapo.algorithm, _settings(), topology)
    grpo = _config("grpo")
    with pytest.raises(ValueError, match="reference policy"):
        train_on_batch(models, batch, minis, grpo.algorithm, _settings(), topology)
