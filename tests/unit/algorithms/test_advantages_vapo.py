"""VAPO's advantages (`streamrl.algorithms.vapo`): GAE against a direct, non-recursive sum,
the length-adaptive λ_policy = 1 − 1/(α·l) (clamped at 0 below l = 1/α), and
`vapo_advantages`, whose policy advantages use λ_policy and whose value targets are the
Monte-Carlo outcome (λ_critic = 1).
"""

from __future__ import annotations

import pytest
import torch

from streamrl.algorithms.advantages import gae, length_adaptive_lambda, vapo_advantages
from tests.unit.algorithms.advantage_reference import (
    SEEDS,
    close,
    random_mask,
    random_rewards,
    ref_outcome_token_rewards,
)


def ref_gae(
    token_rewards: list[list[float]],
    values: list[list[float]],
    mask: list[list[float]],
    gamma: float,
    lams: list[float],
) -> tuple[list[list[float]], list[list[float]]]:
    """Direct (non-recursive) GAE: A_t = Σ_l (γλ)^l δ_{t+l}, δ_t = r_t + γ V_{t+1} − V_t with
    V after the last valid token = 0; return_t = A_t + V_t."""
    adv_all, ret_all = [], []
    for i in range(len(mask)):
        T = len(mask[i])
        L = sum(1 for m in mask[i] if m)
        assert all(mask[i][t] for t in range(L)), "reference expects right-padded masks"
        lam = lams[i]
        deltas = []
        for t in range(L):
            v_next = values[i][t + 1] if t + 1 < L else 0.0
            deltas.append(token_rewards[i][t] + gamma * v_next - values[i][t])
        adv = [0.0] * T
        ret = [0.0] * T
        for t in range(L):
            adv[t] = sum((gamma * lam) ** k * deltas[t + k] for k in range(L - t))
            ret[t] = adv[t] + values[i][t]
        adv_all.append(adv)
        ret_all.append(ret)
    return adv_all, ret_all


def ref_length_adaptive_lambda(length: float, alpha: float = 0.05) -> float:
    """λ_policy = 1 − 1/(α·l), clamped to [0, 1] (documented departure for l < 1/α)."""
    if length <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - 1.0 / (alpha * length)))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (1.0, 0.95), (0.99, 0.9), (0.9, 0.0)])
def test_gae_matches_reference(seed: int, gamma: float, lam: float) -> None:
    """gae with scalar λ equals the direct sum A_t = Σ_l (γλ)^l δ_{t+l}; returns = A + V."""
    gen = torch.Generator().manual_seed(1000 + seed)
    n, t = 7, 9
    mask = random_mask(gen, n, t, as_bool=bool(seed % 2))
    r = torch.randn(n, t, generator=gen)
    v = torch.randn(n, t, generator=gen)
    # Garbage in the padding must be ignored (V after the last valid token is 0).
    pad = ~mask.bool()
    r[pad] = 50.0
    v[pad] = -40.0
    adv, ret = gae(r, v, mask, gamma, lam)
    ref_adv, ref_ret = ref_gae(r.tolist(), v.tolist(), mask.tolist(), gamma, [lam] * n)
    close(adv, ref_adv)
    close(ret, ref_ret)


@pytest.mark.parametrize("seed", SEEDS)
def test_gae_per_response_lambda_matches_reference(seed: int) -> None:
    """gae with λ given per response `[N]` uses each row's own λ."""
    gen = torch.Generator().manual_seed(1100 + seed)
    n, t = 6, 8
    mask = random_mask(gen, n, t)
    r = torch.randn(n, t, generator=gen)
    v = torch.randn(n, t, generator=gen)
    lams = torch.rand(n, generator=gen)
    adv, ret = gae(r, v, mask, 0.97, lams)
    ref_adv, ref_ret = ref_gae(r.tolist(), v.tolist(), mask.tolist(), 0.97, lams.tolist())
    close(adv, ref_adv)
    close(ret, ref_ret)


@pytest.mark.parametrize("seed", SEEDS)
def test_gae_gamma_lambda_one_is_reward_to_go_minus_value(seed: int) -> None:
    """γ = λ = 1: A_t = Σ_{k≥t} r_k − V_t and return_t = Σ_{k≥t} r_k, per token."""
    gen = torch.Generator().manual_seed(1200 + seed)
    n, t = 6, 8
    mask = random_mask(gen, n, t)
    r = torch.randn(n, t, generator=gen)
    v = torch.randn(n, t, generator=gen)
    adv, ret = gae(r, v, mask, 1.0, 1.0)
    ml, rl, vl = mask.tolist(), r.tolist(), v.tolist()
    exp_adv = [[0.0] * t for _ in range(n)]
    exp_ret = [[0.0] * t for _ in range(n)]
    for i in range(n):
        for s in range(t):
            if ml[i][s]:
                rtg = sum(rl[i][k] for k in range(s, t) if ml[i][k])
                exp_ret[i][s] = rtg
                exp_adv[i][s] = rtg - vl[i][s]
    close(adv, exp_adv)
    close(ret, exp_ret)


def test_gae_hand_example() -> None:
    """Two tokens, γ = 0.5, λ = 0.5: δ = [r0 + .5·V1 − V0, r1 − V1], A0 = δ0 + .25·δ1."""
    r = torch.tensor([[1.0, 2.0, 0.0]])
    v = torch.tensor([[0.5, 1.0, 9.0]])
    mask = torch.tensor([[1, 1, 0]])
    d0 = 1.0 + 0.5 * 1.0 - 0.5
    d1 = 2.0 - 1.0
    adv, ret = gae(r, v, mask, 0.5, 0.5)
    close(adv, [[d0 + 0.25 * d1, d1, 0.0]], atol=1e-7, rtol=0)
    close(ret, [[d0 + 0.25 * d1 + 0.5, d1 + 1.0, 0.0]], atol=1e-7, rtol=0)


def test_gae_fully_masked_and_length_one_rows() -> None:
    """Fully masked rows give zeros (no NaN) and do not change other rows; a length-1 row has
    A = r_0 − V_0 (no bootstrap)."""
    gen = torch.Generator().manual_seed(5)
    r = torch.randn(3, 5, generator=gen)
    v = torch.randn(3, 5, generator=gen)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    adv, ret = gae(r, v, mask, 0.99, 0.95)
    assert torch.isfinite(adv).all()
    assert torch.isfinite(ret).all()
    assert torch.all(adv[1] == 0.0)
    assert torch.all(ret[1] == 0.0)
    assert adv[2, 0].item() == pytest.approx(r[2, 0].item() - v[2, 0].item(), abs=1e-6)
    assert ret[2, 0].item() == pytest.approx(r[2, 0].item(), abs=1e-6)
    adv_alone, ret_alone = gae(r[[0, 2]], v[[0, 2]], mask[[0, 2]], 0.99, 0.95)
    torch.testing.assert_close(adv[[0, 2]], adv_alone, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ret[[0, 2]], ret_alone, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    ("length", "expected"),
    [(100, 0.8), (1000, 0.98), (20, 0.0), (40, 0.5), (200, 0.9), (10_000, 0.998)],
)
def test_length_adaptive_lambda_values(length: int, expected: float) -> None:
    """λ_policy = 1 − 1/(0.05·l): l = 100 → 0.8, l = 1000 → 0.98, hand-computed others."""
    out = length_adaptive_lambda(torch.tensor([length]))
    assert out.dtype == torch.float32
    assert out.item() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("length", [0, 1, 5, 19])
def test_length_adaptive_lambda_clamped_at_zero_below_twenty(length: int) -> None:
    """For l < 1/α = 20 the raw λ is negative; it is clamped to 0 (documented departure)."""
    out = length_adaptive_lambda(torch.tensor([length]))
    assert out.item() == 0.0


def test_length_adaptive_lambda_matches_reference() -> None:
    """Elementwise agreement with the clamped formula, for several α and lengths."""
    lengths = torch.tensor([1, 3, 19, 20, 21, 37, 64, 100, 333, 1000, 4096, 20480])
    for alpha in (0.05, 0.1, 0.01):
        out = length_adaptive_lambda(lengths, alpha)
        expected = [ref_length_adaptive_lambda(float(l_), alpha) for l_ in lengths.tolist()]
        close(out, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
def test_vapo_advantages_match_reference(seed: int) -> None:
    """VAPO: policy advantages = GAE(γ=1, λ_policy(|o_i|)), value targets = GAE(λ_critic) + V,
    with R_i on the last valid token."""
    gen = torch.Generator().manual_seed(1300 + seed)
    n = 6
    # Lengths around 1/α = 20 so that λ_policy spans 0 (clamped) .. ~0.9.
    t = 45
    lengths = torch.randint(1, t + 1, (n,), generator=gen)
    lengths[0], lengths[1], lengths[2] = 1, 0, t
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    rewards = random_rewards(gen, n, "binary")
    values = torch.randn(n, t, generator=gen) * 0.5
    pol, tgt = vapo_advantages(rewards, values, mask)
    ml, vl = mask.tolist(), values.tolist()
    token_r = ref_outcome_token_rewards(rewards.tolist(), ml)
    lams = [ref_length_adaptive_lambda(float(sum(row))) for row in ml]
    ref_pol, _ = ref_gae(token_r, vl, ml, 1.0, lams)
    _, ref_tgt = ref_gae(token_r, vl, ml, 1.0, [1.0] * n)
    close(pol, ref_pol)
    close(tgt, ref_tgt)
    assert torch.isfinite(pol).all()
    assert torch.isfinite(tgt).all()
    assert torch.all(pol[1] == 0.0)
    assert torch.all(tgt[1] == 0.0)


@pytest.mark.parametrize("seed", SEEDS)
def test_vapo_value_targets_are_monte_carlo_outcome(seed: int) -> None:
    """λ_critic = 1, γ = 1: every valid token's value target is R_i, whatever V is."""
    gen = torch.Generator().manual_seed(1400 + seed)
    n, t = 7, 12
    mask = random_mask(gen, n, t)
    rewards = random_rewards(gen, n, "continuous")
    values = torch.randn(n, t, generator=gen) * 3.0
    _, tgt = vapo_advantages(rewards, values, mask)
    ml, rl = mask.tolist(), rewards.tolist()
    expected = [[rl[i] if ml[i][s] else 0.0 for s in range(t)] for i in range(n)]
    close(tgt, expected)


def test_vapo_policy_lambda_depends_on_length() -> None:
    """Two responses of lengths 100 and 1000 use λ = 0.8 and 0.98 respectively."""
    t = 1000
    lengths = torch.tensor([100, 1000])
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(2, t, generator=gen) * 0.1
    rewards = torch.tensor([1.0, -1.0])
    pol, _ = vapo_advantages(rewards, values, mask)
    ml = mask.tolist()
    token_r = ref_outcome_token_rewards(rewards.tolist(), ml)
    ref_pol, _ = ref_gae(token_r, values.tolist(), ml, 1.0, [0.8, 0.98])
    close(pol, ref_pol)
    # The last valid token: A = R − V_last, independent of λ.
    assert pol[0, 99].item() == pytest.approx(1.0 - values[0, 99].item(), abs=1e-6)
    # One token earlier: δ_{L−2} + λ·δ_{L−1} with δ_{L−2} = V_{L−1} − V_{L−2}.
    v = values[0]
    expected_98 = (v[99] - v[98]).item() + 0.8 * (1.0 - v[99].item())
    assert pol[0, 98].item() == pytest.approx(expected_98, abs=1e-5)


def test_vapo_length_one_responses() -> None:
    """Length-1 responses: λ_policy = 0, policy advantage = R − V_0, target = R."""
    rewards = torch.tensor([1.0, -1.0])
    values = torch.tensor([[0.3, 5.0], [-0.2, 5.0]])
    mask = torch.tensor([[1, 0], [1, 0]])
    pol, tgt = vapo_advantages(rewards, values, mask)
    close(pol, [[0.7, 0.0], [-0.8, 0.0]], atol=1e-6, rtol=0)
    close(tgt, [[1.0, 0.0], [-1.0, 0.0]], atol=1e-6, rtol=0)
