"""PPO with a critic (`algorithm.name: ppo`, the `vc_ppo` and `orz` presets): GAE at a fixed
λ_policy for the policy and λ_critic for the value targets, against GAE written here as a plain
backward loop over tokens; its defaults; VAPO's length-adaptive λ unchanged beside it; the
guide's weighted value integration (the policy's GAE on the blended values, w(t))."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import TypeAdapter

from streamrl.algorithms.config import AlgorithmConfig, PPOConfig, VAPOConfig


def ref_gae(reward: float, values: list[float], length: int, gamma: float, lam: float):
    """(advantages, returns) of one response of `length` tokens, the reward on its last."""
    adv = [0.0] * len(values)
    running = 0.0
    for t in reversed(range(length)):
        next_value = values[t + 1] if t + 1 < length else 0.0
        r = reward if t == length - 1 else 0.0
        delta = r + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        adv[t] = running
    pairs = enumerate(zip(adv, values, strict=True))
    return adv, [a + v if t < length else 0.0 for t, (a, v) in pairs]


@pytest.mark.parametrize(
    ("lam_policy", "lam_critic", "gamma"), [(0.95, 1.0, 1.0), (1.0, 1.0, 1.0), (0.9, 0.95, 0.99)]
)
def test_ppo_gae_matches_the_reference(lam_policy, lam_critic, gamma):
    config = PPOConfig(lam_policy=lam_policy, lam_critic=lam_critic, gamma=gamma)
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 1, 3]
    mask = (torch.arange(5)[None] < torch.tensor(lengths)[:, None]).float()
    values = torch.randn(3, 5, generator=gen) * mask
    rewards = torch.tensor([1.0, -1.0, 0.5])
    advantages, targets = config.token_advantages(rewards, mask, values=values)
    for i, length in enumerate(lengths):
        vals = values[i].tolist()
        adv, _ = ref_gae(rewards[i].item(), vals, length, gamma, lam_policy)
        _, ret = ref_gae(rewards[i].item(), vals, length, gamma, lam_critic)
        assert advantages[i, :length].tolist() == pytest.approx(adv[:length], abs=1e-5)
        assert targets[i, :length].tolist() == pytest.approx(ret[:length], abs=1e-5)


def test_ppo_defaults_and_what_it_does_not_have():
    ppo = TypeAdapter(AlgorithmConfig).validate_python({"name": "ppo"})
    assert isinstance(ppo, PPOConfig)
    assert (
        ppo.lam_policy,
        ppo.lam_critic,
        ppo.policy_loss.clip_high,
        ppo.policy_loss.dual_clip,
    ) == (0.95, 0.95, 0.2, None)
    assert ppo.positive_nll_coef == 0.0
    assert ppo.value_pretrain_steps == 0
    assert ppo.uses_value_model
    assert "length_alpha" not in PPOConfig.model_fields
    assert "lam_policy" not in VAPOConfig.model_fields


def test_vapo_keeps_its_length_adaptive_lambda():
    vapo = VAPOConfig()
    lengths = torch.tensor([10.0, 40.0, 100.0])
    assert vapo.policy_lambda(lengths).tolist() == pytest.approx([0.0, 0.5, 0.8])


# -- weighted value integration (the guide's eqs 17–18) --------------------------------------


def test_the_policys_gae_runs_on_the_blended_values_and_the_critics_targets_on_its_own():
    config = VAPOConfig(value_prior={"w0": 0.7})
    gen = torch.Generator().manual_seed(1)
    lengths = [6, 2]
    mask = (torch.arange(6)[None] < torch.tensor(lengths)[:, None]).float()
    critic, prior = (torch.randn(2, 6, generator=gen) * mask for _ in range(2))
    w = 0.3
    blended = w * prior + (1 - w) * critic
    rewards = torch.tensor([1.0, -1.0])
    advantages, targets = config.token_advantages(
        rewards, mask, values=critic, policy_values=blended
    )
    lam = config.policy_lambda(mask.sum(-1))
    for i, length in enumerate(lengths):
        pairs = zip(prior[i].tolist(), critic[i].tolist(), strict=True)
        v_aug = [w * p + (1 - w) * c for p, c in pairs]
        adv, _ = ref_gae(rewards[i].item(), v_aug, length, 1.0, float(lam[i]))
        _, ret = ref_gae(rewards[i].item(), critic[i].tolist(), length, 1.0, 1.0)
        assert advantages[i, :length].tolist() == pytest.approx(adv[:length], abs=1e-5)
        assert targets[i, :length].tolist() == pytest.approx(ret[:length], abs=1e-5)


def test_the_prior_weight_decays_over_the_run_and_with_the_critics_reliability():
    prior = VAPOConfig(value_prior={"w0": 0.6, "kappa": 2.0, "eta": 3.0, "ev_ema": 0.5})
    config = prior.critic_prior
    assert config.weight(0, 100, 0.0) == pytest.approx(0.6)
    assert config.weight(50, 100, 0.25) == pytest.approx(0.6 * math.exp(-1.0) / 1.75)
    rel = 0.0
    for ev in [-3.0, 0.4, 2.0]:  # clipped to [0, 1]
        rel = 0.5 * rel + 0.5 * min(max(ev, 0.0), 1.0)
    got = 0.0
    for ev in [-3.0, 0.4, 2.0]:
        got = config.reliability(got, ev)
    assert got == pytest.approx(rel)
    assert VAPOConfig().critic_prior is None
    with pytest.raises(ValueError, match="w0"):
        VAPOConfig(value_prior={"w0": 1.5})
