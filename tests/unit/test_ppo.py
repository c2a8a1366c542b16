"""PPO with a critic (`algorithm.name: ppo`, the `vc_ppo` and `orz` presets): GAE at a fixed
λ_policy for the policy and λ_critic for the value targets, against GAE written here as a plain
backward loop over tokens; its defaults; VAPO's length-adaptive λ unchanged beside it."""

from __future__ import annotations

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
    assert (ppo.lam_policy, ppo.lam_critic, ppo.clip_high, ppo.dual_clip) == (0.95, 0.95, 0.2, None)
    assert ppo.positive_nll_coef == 0.0
    assert ppo.value_pretrain_steps == 0
    assert ppo.uses_value_model
    assert "length_alpha" not in PPOConfig.model_fields
    assert "lam_policy" not in VAPOConfig.model_fields


def test_vapo_keeps_its_length_adaptive_lambda():
    vapo = VAPOConfig()
    lengths = torch.tensor([10.0, 40.0, 100.0])
    assert vapo.policy_lambda(lengths).tolist() == pytest.approx([0.0, 0.5, 0.8])
