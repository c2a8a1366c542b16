"""Tests for `streamrl.algorithms.advantages` and `streamrl.algorithms.masked`.

Every public function is compared with an independent reference written here with explicit
Python loops over samples and tokens, straight from the formulas in ALGORITHMS.md (computed in
Python floats, i.e. float64), on seeded random batches with ragged, non-contiguous groups and
ragged right-padded masks. Special cases from ALGORITHMS.md get their own tests.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from streamrl.algorithms.advantages import (
    broadcast_to_tokens,
    dr_grpo_advantages,
    gae,
    gpg_advantages,
    groups_with_signal,
    grpo_advantages,
    length_adaptive_lambda,
    outcome_token_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
    vapo_advantages,
)
from streamrl.algorithms.masked import (
    group_count,
    group_mean,
    group_std,
    masked_mean,
    masked_sum,
    masked_whiten,
)

ATOL = 1e-5
RTOL = 1e-5
SEEDS = [0, 1, 2, 3, 4]


def _close(actual, expected, atol: float = ATOL, rtol: float = RTOL) -> None:
    """assert_close of a tensor against a (nested) list of Python floats, in float32."""
    expected_t = torch.as_tensor(expected, dtype=torch.float64).to(torch.float32)
    torch.testing.assert_close(actual.float(), expected_t, atol=atol, rtol=rtol)


# --------------------------------------------------------------------------------------------
# Random batches
# --------------------------------------------------------------------------------------------


def _random_group_index(gen: torch.Generator, num_groups: int, max_size: int = 6) -> torch.Tensor:
    """Dense group ids with ragged sizes in 1..max_size, shuffled (groups not contiguous)."""
    sizes = torch.randint(1, max_size + 1, (num_groups,), generator=gen)
    sizes[0] = 1  # always at least one group of one response
    ids = torch.repeat_interleave(torch.arange(num_groups), sizes)
    return ids[torch.randperm(ids.numel(), generator=gen)].to(torch.int64)


def _random_rewards(gen: torch.Generator, n: int, kind: str) -> torch.Tensor:
    if kind == "binary":
        return torch.randint(0, 2, (n,), generator=gen).float() * 2.0 - 1.0
    return torch.randn(n, generator=gen) * 2.0 + 0.3


def _random_mask(
    gen: torch.Generator, n: int, t: int, *, allow_empty: bool = True, as_bool: bool = True
) -> torch.Tensor:
    """Right-padded mask with ragged lengths; includes a length-1 row and (optionally) an
    empty row."""
    lo = 0 if allow_empty else 1
    lengths = torch.randint(lo, t + 1, (n,), generator=gen)
    lengths[0] = 1
    if allow_empty and n > 1:
        lengths[1] = 0
    if n > 2:
        lengths[2] = t
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    return mask if as_bool else mask.float()


def _groups(group_index: list[int]) -> dict[int, list[int]]:
    members: dict[int, list[int]] = {}
    for i, g in enumerate(group_index):
        members.setdefault(g, []).append(i)
    return members


# --------------------------------------------------------------------------------------------
# Reference implementations (plain Python loops over floats)
# --------------------------------------------------------------------------------------------


def ref_masked_sum(x: list[list[float]], mask: list[list[float]]) -> float:
    total = 0.0
    for i in range(len(x)):
        for t in range(len(x[i])):
            if mask[i][t]:
                total += x[i][t]
    return total


def ref_masked_mean(x: list[list[float]], mask: list[list[float]]) -> float:
    count = sum(1 for row in mask for m in row if m)
    return ref_masked_sum(x, mask) / count if count else 0.0


def ref_masked_whiten(
    x: list[list[float]], mask: list[list[float]], eps: float = 1e-8
) -> list[list[float]]:
    """(x − μ)/sqrt(σ² + eps), σ² the unbiased variance over the valid elements.

    With a single valid element the unbiased variance has no meaning; the implementation's
    convention is to divide by max(n − 1, 1), which the output does not depend on then anyway
    (x − μ = 0).
    """
    vals = [x[i][t] for i in range(len(x)) for t in range(len(x[i])) if mask[i][t]]
    n = len(vals)
    mu = sum(vals) / n if n else 0.0
    var = sum((v - mu) ** 2 for v in vals) / max(n - 1, 1)
    denom = math.sqrt(var + eps)
    out = []
    for i in range(len(x)):
        out.append([(x[i][t] - mu) / denom if mask[i][t] else 0.0 for t in range(len(x[i]))])
    return out


def ref_group_count(group_index: list[int], num_groups: int) -> list[float]:
    counts = [0.0] * num_groups
    for g in group_index:
        counts[g] += 1.0
    return counts


def ref_group_mean(values: list[float], group_index: list[int], num_groups: int) -> list[float]:
    members = _groups(group_index)
    return [
        statistics.fmean(values[i] for i in members[g]) if g in members else 0.0
        for g in range(num_groups)
    ]


def ref_group_std(values: list[float], group_index: list[int], num_groups: int) -> list[float]:
    members = _groups(group_index)
    out = []
    for g in range(num_groups):
        vals = [values[i] for i in members.get(g, [])]
        out.append(statistics.stdev(vals) if len(vals) >= 2 else 0.0)
    return out


def ref_grpo(rewards: list[float], group_index: list[int], eps: float = 1e-6) -> list[float]:
    members = _groups(group_index)
    out = []
    for i, g in enumerate(group_index):
        vals = [rewards[j] for j in members[g]]
        if len(vals) == 1:
            out.append(0.0)
            continue
        mean = statistics.fmean(vals)
        std = statistics.stdev(vals)
        out.append((rewards[i] - mean) / (std + eps))
    return out


def ref_dr_grpo(rewards: list[float], group_index: list[int]) -> list[float]:
    members = _groups(group_index)
    out = []
    for i, g in enumerate(group_index):
        mean = statistics.fmean(rewards[j] for j in members[g])
        out.append(rewards[i] - mean)
    return out


def ref_rloo(rewards: list[float], group_index: list[int]) -> list[float]:
    members = _groups(group_index)
    out = []
    for i, g in enumerate(group_index):
        others = [rewards[j] for j in members[g] if j != i]
        if not others:
            out.append(0.0)
            continue
        out.append(rewards[i] - sum(others) / len(others))
    return out


def ref_groups_with_signal(
    rewards: list[float], group_index: list[int], num_groups: int
) -> list[bool]:
    members = _groups(group_index)
    return [len({rewards[i] for i in members.get(g, [])}) > 1 for g in range(num_groups)]


def ref_gpg(
    rewards: list[float], group_index: list[int], num_groups: int
) -> tuple[list[float], float]:
    members = _groups(group_index)
    B = num_groups
    M = 0
    for g in range(num_groups):
        vals = [rewards[i] for i in members.get(g, [])]
        if all(v == vals[0] for v in vals):
            M += 1
    alpha = B / (B - M) if B > M else 1.0
    out = []
    for i, g in enumerate(group_index):
        mean = statistics.fmean(rewards[j] for j in members[g])
        out.append(alpha * (rewards[i] - mean))
    return out, alpha


def ref_outcome_token_rewards(rewards: list[float], mask: list[list[float]]) -> list[list[float]]:
    out = []
    for i in range(len(mask)):
        row = [0.0] * len(mask[i])
        valid = [t for t in range(len(mask[i])) if mask[i][t]]
        if valid:
            row[max(valid)] = rewards[i]
        out.append(row)
    return out


def ref_broadcast(adv: list[float], mask: list[list[float]]) -> list[list[float]]:
    return [[adv[i] if mask[i][t] else 0.0 for t in range(len(mask[i]))] for i in range(len(adv))]


def ref_reinforce_pp(
    rewards: list[float],
    mask: list[list[float]],
    kl: list[list[float]] | None,
    beta: float,
    group_index: list[int] | None = None,
) -> list[list[float]]:
    """REINFORCE++(-baseline): r_t = −β·KL_t (+ R_i at the last valid token), reward-to-go
    with γ = 1, whitened over every valid token of the batch."""
    if group_index is not None:
        members = _groups(group_index)
        rewards = [
            rewards[i] - statistics.fmean(rewards[j] for j in members[g])
            for i, g in enumerate(group_index)
        ]
    returns = []
    for i in range(len(mask)):
        T = len(mask[i])
        valid = [t for t in range(T) if mask[i][t]]
        r = [0.0] * T
        for t in valid:
            r[t] = -beta * kl[i][t] if kl is not None else 0.0
        if valid:
            r[max(valid)] += rewards[i]
        row = []
        for t in range(T):
            row.append(sum(r[k] for k in range(t, T) if mask[i][k]) if mask[i][t] else 0.0)
        returns.append(row)
    return ref_masked_whiten(returns, mask, eps=1e-8)


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


# --------------------------------------------------------------------------------------------
# masked.py
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("as_bool", [True, False])
def test_masked_sum_and_mean_match_reference(seed: int, as_bool: bool) -> None:
    """masked_sum / masked_mean equal the looped Σ x·m and Σ x·m / Σ m."""
    gen = torch.Generator().manual_seed(seed)
    n, t = 7, 9
    x = torch.randn(n, t, generator=gen)
    mask = _random_mask(gen, n, t, as_bool=as_bool)
    _close(masked_sum(x, mask), ref_masked_sum(x.tolist(), mask.tolist()))
    _close(masked_mean(x, mask), ref_masked_mean(x.tolist(), mask.tolist()))


def test_masked_mean_empty_mask_is_zero() -> None:
    """An all-zero mask gives a mean of exactly 0, not NaN."""
    x = torch.randn(3, 4)
    out = masked_mean(x, torch.zeros(3, 4, dtype=torch.bool))
    assert not torch.isnan(out)
    assert out.item() == 0.0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("as_bool", [True, False])
def test_masked_whiten_matches_reference(seed: int, as_bool: bool) -> None:
    """masked_whiten = (x − μ)/sqrt(unbiased σ² + 1e-8) over valid elements, 0 elsewhere."""
    gen = torch.Generator().manual_seed(100 + seed)
    n, t = 6, 11
    x = torch.randn(n, t, generator=gen) * 3.0 + 1.5
    mask = _random_mask(gen, n, t, as_bool=as_bool)
    out = masked_whiten(x, mask)
    _close(out, ref_masked_whiten(x.tolist(), mask.tolist()))
    assert out.dtype == torch.float32
    assert torch.all(out[~mask.bool()] == 0.0)


def test_masked_whiten_statistics_of_output() -> None:
    """Whitened valid elements have mean 0 and unbiased std ≈ 1; padding values are ignored."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 8, generator=gen) * 4.0 - 2.0
    mask = _random_mask(gen, 5, 8, allow_empty=False)
    x_garbage = x.clone()
    x_garbage[~mask] = 1e6
    out = masked_whiten(x_garbage, mask)
    valid = out[mask]
    torch.testing.assert_close(valid.mean(), torch.tensor(0.0), atol=1e-5, rtol=0)
    torch.testing.assert_close(valid.std(), torch.tensor(1.0), atol=1e-4, rtol=0)
    torch.testing.assert_close(out, masked_whiten(x, mask), atol=1e-6, rtol=1e-6)


def test_masked_whiten_epsilon_convention() -> None:
    """Hand example: x = [1, 3] → μ = 2, σ² = 2 (unbiased), out = ±1/sqrt(2 + 1e-8)."""
    x = torch.tensor([[1.0, 3.0, 100.0]])
    mask = torch.tensor([[True, True, False]])
    d = 1.0 / math.sqrt(2.0 + 1e-8)
    _close(masked_whiten(x, mask), [[-d, d, 0.0]], atol=1e-7, rtol=1e-7)
    # A large eps shows it sits inside the square root: 1/sqrt(2 + 2) = 0.5.
    _close(masked_whiten(x, mask, eps=2.0), [[-0.5, 0.5, 0.0]], atol=1e-7, rtol=1e-7)


def test_masked_whiten_constant_and_single_element() -> None:
    """Constant values or a single valid element whiten to 0 with no NaN."""
    x = torch.full((2, 3), 0.7)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    out = masked_whiten(x, mask)
    assert torch.isfinite(out).all()
    _close(out, [[0.0] * 3, [0.0] * 3], atol=1e-4, rtol=0)
    single = torch.tensor([[True, False, False], [False, False, False]])
    out = masked_whiten(torch.randn(2, 3), single)
    assert torch.isfinite(out).all()
    assert torch.all(out == 0.0)


@pytest.mark.parametrize("seed", SEEDS)
def test_group_reductions_match_reference(seed: int) -> None:
    """group_count / group_mean / group_std equal per-group loops (std unbiased, G=1 → 0)."""
    gen = torch.Generator().manual_seed(200 + seed)
    num_groups = 6
    gi = _random_group_index(gen, num_groups)
    values = torch.randn(gi.numel(), generator=gen) * 2.0
    gl, vl = gi.tolist(), values.tolist()
    _close(group_count(gi, num_groups), ref_group_count(gl, num_groups))
    _close(group_mean(values, gi, num_groups), ref_group_mean(vl, gl, num_groups))
    _close(group_std(values, gi, num_groups), ref_group_std(vl, gl, num_groups))


def test_group_std_matches_torch_std_per_group() -> None:
    """group_std equals torch.std (unbiased, N − 1) of each group's values."""
    gen = torch.Generator().manual_seed(11)
    gi = _random_group_index(gen, 8, max_size=9)
    values = torch.randn(gi.numel(), generator=gen)
    out = group_std(values, gi, 8)
    for g in range(8):
        vals = values[gi == g]
        expected = vals.std() if vals.numel() > 1 else torch.tensor(0.0)
        torch.testing.assert_close(out[g], expected, atol=1e-6, rtol=1e-5)


def test_group_reductions_empty_group_and_singleton() -> None:
    """An id with no members has count 0, mean 0, std 0; a singleton has std 0, not NaN."""
    gi = torch.tensor([0, 2, 0], dtype=torch.int64)
    values = torch.tensor([1.0, 5.0, 3.0])
    _close(group_count(gi, 3), [2.0, 0.0, 1.0])
    _close(group_mean(values, gi, 3), [2.0, 0.0, 5.0])
    _close(group_std(values, gi, 3), [math.sqrt(2.0), 0.0, 0.0])


# --------------------------------------------------------------------------------------------
# Outcome-reward estimators: GRPO, Dr. GRPO, RLOO, GPG
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", ["binary", "continuous"])
def test_grpo_matches_reference(seed: int, kind: str) -> None:
    """GRPO: (R − mean_g)/(std_g + 1e-6) with unbiased std; G = 1 → 0."""
    gen = torch.Generator().manual_seed(300 + seed)
    num_groups = 7
    gi = _random_group_index(gen, num_groups)
    rewards = _random_rewards(gen, gi.numel(), kind)
    out = grpo_advantages(rewards, gi, num_groups)
    assert out.dtype == torch.float32
    _close(out, ref_grpo(rewards.tolist(), gi.tolist()))


def test_grpo_std_is_unbiased_hand_example() -> None:
    """R = [1, 0, 0, 0]: mean 0.25, unbiased std 0.5 → A = [1.5, −0.5, −0.5, −0.5]/(1 + 2e-6)."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    gi = torch.zeros(4, dtype=torch.int64)
    std = 0.5
    expected = [0.75 / (std + 1e-6)] + [-0.25 / (std + 1e-6)] * 3
    _close(grpo_advantages(rewards, gi, 1), expected, atol=1e-6, rtol=1e-6)
    # The biased (population) std would be sqrt(3)/4 and give 1.732 for the first response.
    assert abs(grpo_advantages(rewards, gi, 1)[0].item() - 0.75 / (math.sqrt(3) / 4)) > 0.1


@pytest.mark.parametrize("seed", SEEDS)
def test_grpo_uses_torch_std_per_group(seed: int) -> None:
    """GRPO denominators are torch.std of each group (unbiased) plus 1e-6."""
    gen = torch.Generator().manual_seed(350 + seed)
    gi = _random_group_index(gen, 5)
    rewards = torch.randn(gi.numel(), generator=gen)
    out = grpo_advantages(rewards, gi, 5)
    for g in range(5):
        sel = gi == g
        vals = rewards[sel]
        if vals.numel() == 1:
            assert torch.all(out[sel] == 0.0)
            continue
        expected = (vals - vals.mean()) / (vals.std() + 1e-6)
        torch.testing.assert_close(out[sel], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", ["binary", "continuous"])
def test_dr_grpo_matches_reference(seed: int, kind: str) -> None:
    """Dr. GRPO: A = R − mean_g R."""
    gen = torch.Generator().manual_seed(400 + seed)
    gi = _random_group_index(gen, 6)
    rewards = _random_rewards(gen, gi.numel(), kind)
    _close(dr_grpo_advantages(rewards, gi, 6), ref_dr_grpo(rewards.tolist(), gi.tolist()))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", ["binary", "continuous"])
def test_rloo_matches_reference(seed: int, kind: str) -> None:
    """RLOO: A_i = R_i − Σ_{j≠i} R_j / (G − 1); G = 1 → 0."""
    gen = torch.Generator().manual_seed(500 + seed)
    gi = _random_group_index(gen, 6)
    rewards = _random_rewards(gen, gi.numel(), kind)
    _close(rloo_advantages(rewards, gi, 6), ref_rloo(rewards.tolist(), gi.tolist()))


@pytest.mark.parametrize("seed", SEEDS)
def test_rloo_is_scaled_mean_centred_reward(seed: int) -> None:
    """RLOO = G/(G − 1) · (R − mean_g R) for every group with G ≥ 2."""
    gen = torch.Generator().manual_seed(550 + seed)
    gi = _random_group_index(gen, 6)
    rewards = _random_rewards(gen, gi.numel(), "continuous")
    out = rloo_advantages(rewards, gi, 6)
    members = _groups(gi.tolist())
    rl = rewards.tolist()
    for i, g in enumerate(gi.tolist()):
        G = len(members[g])
        if G == 1:
            assert out[i].item() == 0.0
            continue
        mean = sum(rl[j] for j in members[g]) / G
        expected = G / (G - 1) * (rl[i] - mean)
        assert out[i].item() == pytest.approx(expected, abs=1e-5, rel=1e-5)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", ["binary", "continuous"])
def test_gpg_matches_reference(seed: int, kind: str) -> None:
    """GPG: A = α(R − mean_g R), α = B/(B − M), M = zero-variance groups (incl. G = 1)."""
    gen = torch.Generator().manual_seed(600 + seed)
    num_groups = 8
    gi = _random_group_index(gen, num_groups - 1, max_size=4)
    rewards = _random_rewards(gen, gi.numel(), kind)
    # Force one multi-response zero-variance group so that M ≥ 2 (group 0 is a singleton), and
    # append one informative group so that M < B.
    rewards[gi == 1] = 1.0
    gi = torch.cat([gi, torch.tensor([num_groups - 1] * 2)])
    rewards = torch.cat([rewards, torch.tensor([1.0, -1.0])])
    adv, alpha = gpg_advantages(rewards, gi, num_groups)
    ref_adv, ref_alpha = ref_gpg(rewards.tolist(), gi.tolist(), num_groups)
    assert alpha.item() == pytest.approx(ref_alpha, rel=1e-6)
    assert ref_alpha > 1.0
    _close(adv, ref_adv)


def test_gpg_alpha_hand_example() -> None:
    """B = 4 groups, M = 2 zero-variance ([1, 1] and a singleton) → α = 4/2 = 2."""
    gi = torch.tensor([0, 1, 0, 2, 1, 3, 3], dtype=torch.int64)
    rewards = torch.tensor([1.0, 1.0, -1.0, 0.5, 1.0, 0.0, 1.0])
    adv, alpha = gpg_advantages(rewards, gi, 4)
    assert alpha.item() == pytest.approx(2.0)
    _close(adv, [2.0, 0.0, -2.0, 0.0, 0.0, -1.0, 1.0], atol=1e-6, rtol=1e-6)


def test_gpg_counts_groups_without_signal_on_correctness_not_shaped_rewards() -> None:
    """Group 0 is all wrong, its rewards differ only by an overlong penalty: no signal, so
    M = 1 and α = 2 (counting it on the rewards would give α = 1)."""
    gi = torch.tensor([0, 0, 1, 1], dtype=torch.int64)
    scores = torch.tensor([0.0, 0.0, 1.0, 0.0])
    rewards = torch.tensor([-1.0, -1.25, 1.0, -1.0])
    adv, alpha = gpg_advantages(rewards, gi, 2, scores)
    assert alpha.item() == pytest.approx(2.0)
    _close(adv, [0.25, -0.25, 2.0, -2.0], atol=1e-6, rtol=1e-6)
    assert gpg_advantages(rewards, gi, 2)[1].item() == pytest.approx(1.0)


def test_gpg_alpha_is_one_when_every_group_has_zero_variance() -> None:
    """M = B → α = 1 (documented departure) and every advantage is 0, no NaN/inf."""
    gi = torch.tensor([0, 0, 1, 2, 2, 2], dtype=torch.int64)
    rewards = torch.tensor([1.0, 1.0, -1.0, 0.7, 0.7, 0.7])
    adv, alpha = gpg_advantages(rewards, gi, 3)
    assert alpha.item() == 1.0
    assert torch.isfinite(adv).all()
    _close(adv, [0.0] * 6, atol=1e-6, rtol=0)


OUTCOME_ESTIMATORS = {
    "grpo": lambda r, gi, ng: grpo_advantages(r, gi, ng),
    "dr_grpo": lambda r, gi, ng: dr_grpo_advantages(r, gi, ng),
    "rloo": lambda r, gi, ng: rloo_advantages(r, gi, ng),
    "gpg": lambda r, gi, ng: gpg_advantages(r, gi, ng)[0],
}


@pytest.mark.parametrize("name", sorted(OUTCOME_ESTIMATORS))
@pytest.mark.parametrize("value", [1.0, -1.0, 0.0, 0.5, 0.7, 0.1, -0.45])
@pytest.mark.parametrize("G", [2, 3, 7, 16])
def test_outcome_estimators_zero_for_all_equal_group(name: str, value: float, G: int) -> None:
    """All rewards equal in a group → advantage 0 (no NaN), whatever the shared value.

    Values like 0.7 (= +1 with a −0.3 overlong penalty) are not exact in float32; the formula
    still gives 0 (R − mean = 0, std = 0), so the result must be ~0, not a rounding residue
    amplified by 1/(0 + 1e-6).
    """
    fn = OUTCOME_ESTIMATORS[name]
    # Group 0 all equal, group 1 informative so that GPG's α stays finite and > 1.
    rewards = torch.tensor([value] * G + [1.0, -1.0, 0.0])
    gi = torch.tensor([0] * G + [1, 1, 1], dtype=torch.int64)
    out = fn(rewards, gi, 2)
    assert torch.isfinite(out).all()
    _close(out[:G], [0.0] * G, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", sorted(OUTCOME_ESTIMATORS))
@pytest.mark.parametrize("value", [1.0, 0.0, -0.3])
def test_outcome_estimators_zero_for_group_of_one(name: str, value: float) -> None:
    """A group of one response (G = 1) gets advantage exactly 0, no NaN; others unaffected."""
    fn = OUTCOME_ESTIMATORS[name]
    rewards = torch.tensor([1.0, value, -1.0, 1.0])
    gi = torch.tensor([1, 0, 1, 1], dtype=torch.int64)
    out = fn(rewards, gi, 2)
    assert torch.isfinite(out).all()
    assert out[1].item() == 0.0
    with_single = out[[0, 2, 3]]
    without = fn(rewards[[0, 2, 3]], torch.zeros(3, dtype=torch.int64), 1)
    if name == "gpg":  # B = 2, M = 1 → α = 2 with the singleton; B = 1, M = 0 → α = 1 without.
        without = 2.0 * without
    torch.testing.assert_close(with_single, without, atol=1e-6, rtol=1e-6)


def test_outcome_estimators_hand_example() -> None:
    """Hand-computed R = [1, 0, 0] in one group: mean 1/3, unbiased std sqrt(1/3)."""
    rewards = torch.tensor([1.0, 0.0, 0.0])
    gi = torch.zeros(3, dtype=torch.int64)
    centred = [2 / 3, -1 / 3, -1 / 3]
    std = math.sqrt(1 / 3)
    _close(grpo_advantages(rewards, gi, 1), [c / (std + 1e-6) for c in centred])
    _close(dr_grpo_advantages(rewards, gi, 1), centred)
    _close(rloo_advantages(rewards, gi, 1), [1.0, -0.5, -0.5])
    adv, alpha = gpg_advantages(rewards, gi, 1)
    assert alpha.item() == 1.0
    _close(adv, centred)


# --------------------------------------------------------------------------------------------
# Dynamic sampling, broadcasting, outcome token rewards
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_groups_with_signal_matches_reference(seed: int) -> None:
    """groups_with_signal[g] is True iff the rewards of group g are not all equal."""
    gen = torch.Generator().manual_seed(700 + seed)
    gi = _random_group_index(gen, 10, max_size=4)
    rewards = _random_rewards(gen, gi.numel(), "binary")
    rewards[gi == 2] = 0.7
    out = groups_with_signal(rewards, gi, 10)
    assert out.dtype == torch.bool
    expected = ref_groups_with_signal(rewards.tolist(), gi.tolist(), 10)
    assert out.tolist() == expected
    assert expected[0] is False
    assert expected[2] is False


def test_groups_with_signal_hand_example() -> None:
    """Accuracy 0, 1, 1/2, a singleton and a tiny difference: only mixed groups carry signal."""
    gi = torch.tensor([0, 0, 1, 1, 2, 2, 3, 4, 4], dtype=torch.int64)
    rewards = torch.tensor([-1.0, -1.0, 1.0, 1.0, 1.0, -1.0, 1.0, 0.5, 0.5001])
    assert groups_with_signal(rewards, gi, 5).tolist() == [False, False, True, False, True]


@pytest.mark.parametrize("seed", SEEDS)
def test_broadcast_to_tokens_matches_reference(seed: int) -> None:
    """broadcast_to_tokens puts A_i on every valid token of row i and 0 elsewhere."""
    gen = torch.Generator().manual_seed(750 + seed)
    adv = torch.randn(6, generator=gen)
    mask = _random_mask(gen, 6, 7, as_bool=bool(seed % 2))
    _close(broadcast_to_tokens(adv, mask), ref_broadcast(adv.tolist(), mask.tolist()))


@pytest.mark.parametrize("seed", SEEDS)
def test_outcome_token_rewards_matches_reference(seed: int) -> None:
    """outcome_token_rewards places R_i on the last valid token only (0 on empty rows)."""
    gen = torch.Generator().manual_seed(800 + seed)
    rewards = torch.randn(7, generator=gen)
    mask = _random_mask(gen, 7, 9, as_bool=bool(seed % 2))
    out = outcome_token_rewards(rewards, mask)
    _close(out, ref_outcome_token_rewards(rewards.tolist(), mask.tolist()))


def test_outcome_token_rewards_hand_example() -> None:
    """Lengths 3, 1, 0, 4 in T = 4: R lands at columns 2, 0, nowhere, 3."""
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    out = outcome_token_rewards(torch.tensor([2.0, -1.0, 5.0, 0.5]), mask)
    expected = [[0, 0, 2.0, 0], [-1.0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0.5]]
    _close(out, expected, atol=0, rtol=0)


# --------------------------------------------------------------------------------------------
# REINFORCE++
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_reinforce_pp_matches_reference(seed: int, beta: float) -> None:
    """REINFORCE++ = whitened reward-to-go of (−β·KL_t + R_i at the last token)."""
    gen = torch.Generator().manual_seed(900 + seed)
    n, t = 8, 10
    rewards = _random_rewards(gen, n, "binary" if seed % 2 else "continuous")
    mask = _random_mask(gen, n, t, as_bool=bool(seed % 2))
    kl = torch.rand(n, t, generator=gen) * 0.5
    kl[~mask.bool()] = 123.0  # padding KL must not leak into the returns
    out = reinforce_pp_advantages(rewards, mask, kl, beta)
    assert out.dtype == torch.float32
    expected = ref_reinforce_pp(rewards.tolist(), mask.tolist(), kl.tolist(), beta)
    _close(out, expected)


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_pp_baseline_matches_reference(seed: int) -> None:
    """REINFORCE++-baseline subtracts the group mean reward, then whitens over the batch."""
    gen = torch.Generator().manual_seed(950 + seed)
    gi = _random_group_index(gen, 5)
    n, t = gi.numel(), 8
    rewards = _random_rewards(gen, n, "binary")
    mask = _random_mask(gen, n, t)
    kl = torch.rand(n, t, generator=gen) * 0.3
    out = reinforce_pp_advantages(
        rewards, mask, kl, 0.05, baseline=True, group_index=gi, num_groups=5
    )
    expected = ref_reinforce_pp(rewards.tolist(), mask.tolist(), kl.tolist(), 0.05, gi.tolist())
    _close(out, expected)


def test_reinforce_pp_baseline_requires_groups() -> None:
    """baseline=True without group_index/num_groups raises ValueError."""
    with pytest.raises(ValueError, match="group_index"):
        reinforce_pp_advantages(torch.ones(2), torch.ones(2, 3), baseline=True)


def test_reinforce_pp_hand_example() -> None:
    """Hand example, β = 0.5: returns [[1−0.5·(.2+.4), 1−0.5·.4], [−0.5·.2 − 1]] then whiten."""
    rewards = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    kl = torch.tensor([[0.2, 0.4], [0.2, 9.0]])
    returns = [0.7, 0.8, -1.1]
    mu = sum(returns) / 3
    var = sum((x - mu) ** 2 for x in returns) / 2
    d = math.sqrt(var + 1e-8)
    expected = [[(0.7 - mu) / d, (0.8 - mu) / d], [(-1.1 - mu) / d, 0.0]]
    _close(reinforce_pp_advantages(rewards, mask, kl, 0.5), expected, atol=1e-6, rtol=1e-6)


def test_reinforce_pp_fully_masked_rows_do_not_perturb() -> None:
    """Fully masked rows give zeros (no NaN) and leave every other row's advantages unchanged."""
    gen = torch.Generator().manual_seed(17)
    rewards = torch.randn(4, generator=gen)
    mask = _random_mask(gen, 4, 6, allow_empty=False)
    kl = torch.rand(4, 6, generator=gen)
    base = reinforce_pp_advantages(rewards, mask, kl, 0.1)
    rewards_x = torch.cat([rewards, torch.tensor([5.0, -3.0])])
    mask_x = torch.cat([mask, torch.zeros(2, 6, dtype=torch.bool)])
    kl_x = torch.cat([kl, torch.full((2, 6), 7.0)])
    out = reinforce_pp_advantages(rewards_x, mask_x, kl_x, 0.1)
    assert torch.isfinite(out).all()
    assert torch.all(out[4:] == 0.0)
    torch.testing.assert_close(out[:4], base, atol=1e-6, rtol=1e-6)


def test_reinforce_pp_length_one_responses() -> None:
    """All responses of length 1: advantage = whitened R (unbiased std, eps 1e-8 inside sqrt)."""
    rewards = torch.tensor([1.0, -1.0, 1.0, 0.0])
    mask = torch.tensor([[1, 0, 0], [1, 0, 0], [1, 0, 0], [1, 0, 0]], dtype=torch.bool)
    mu = 0.25
    var = sum((r - mu) ** 2 for r in [1.0, -1.0, 1.0, 0.0]) / 3
    d = math.sqrt(var + 1e-8)
    expected = [[(r - mu) / d, 0.0, 0.0] for r in [1.0, -1.0, 1.0, 0.0]]
    _close(reinforce_pp_advantages(rewards, mask), expected, atol=1e-6, rtol=1e-6)


# --- distributed whitening (2 gloo processes) -----------------------------------------------


def _dist_worker(rank: int, world_size: int, init_file: str, data_path: str, out_dir: str):
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        data = torch.load(data_path)
        sl = slice(*data["slices"][rank])
        pg = dist.group.WORLD
        x, mask = data["x"][sl], data["mask"][sl]
        rewards, kl, gi = data["rewards"][sl], data["kl"][sl], data["gi"][sl]
        gi_local = gi - gi.min()
        ng_local = int(gi_local.max().item()) + 1
        out = {
            "whiten": masked_whiten(x, mask, process_group=pg),
            "rpp": reinforce_pp_advantages(rewards, mask, kl, 0.1, process_group=pg),
            "rpp_base": reinforce_pp_advantages(
                rewards,
                mask,
                kl,
                0.1,
                baseline=True,
                group_index=gi_local,
                num_groups=ng_local,
                process_group=pg,
            ),
        }
        torch.save(out, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_whitening_over_process_group_equals_concatenated_batch(tmp_path) -> None:
    """With a 2-rank gloo group, each rank's masked_whiten / REINFORCE++(-baseline) output
    equals whitening the concatenated batch in one process (and the looped reference)."""
    gen = torch.Generator().manual_seed(2024)
    n, t = 10, 7
    x = torch.randn(n, t, generator=gen) * 2.0 + 1.0
    # Ragged masks so the two halves hold different token counts; one empty row on rank 1.
    lengths = torch.tensor([7, 1, 3, 5, 2, 6, 0, 4, 7, 1])
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    rewards = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0, 0.5, -1.0, 1.0, 1.0, -1.0])
    kl = torch.rand(n, t, generator=gen)
    gi = torch.tensor([0, 1, 0, 1, 1, 2, 3, 2, 3, 3], dtype=torch.int64)  # groups within ranks
    slices = [(0, 5), (5, 10)]
    data_path = tmp_path / "data.pt"
    torch.save(
        {"x": x, "mask": mask, "rewards": rewards, "kl": kl, "gi": gi, "slices": slices}, data_path
    )
    mp.spawn(
        _dist_worker,
        args=(2, str(tmp_path / "rendezvous"), str(data_path), str(tmp_path)),
        nprocs=2,
        join=True,
    )
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    got = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}

    whole = {
        "whiten": masked_whiten(x, mask),
        "rpp": reinforce_pp_advantages(rewards, mask, kl, 0.1),
        "rpp_base": reinforce_pp_advantages(
            rewards, mask, kl, 0.1, baseline=True, group_index=gi, num_groups=4
        ),
    }
    for key in whole:
        torch.testing.assert_close(got[key], whole[key], atol=1e-6, rtol=1e-6)
    ml, kll = mask.tolist(), kl.tolist()
    _close(got["whiten"], ref_masked_whiten(x.tolist(), ml))
    _close(got["rpp"], ref_reinforce_pp(rewards.tolist(), ml, kll, 0.1))
    _close(got["rpp_base"], ref_reinforce_pp(rewards.tolist(), ml, kll, 0.1, gi.tolist()))
    # Whitening each half on its own would differ: the test can tell global from local.
    local = masked_whiten(x[:5], mask[:5])
    assert not torch.allclose(local, got["whiten"][:5], atol=1e-3)


# --------------------------------------------------------------------------------------------
# GAE, length-adaptive λ, VAPO
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (1.0, 0.95), (0.99, 0.9), (0.9, 0.0)])
def test_gae_matches_reference(seed: int, gamma: float, lam: float) -> None:
    """gae with scalar λ equals the direct sum A_t = Σ_l (γλ)^l δ_{t+l}; returns = A + V."""
    gen = torch.Generator().manual_seed(1000 + seed)
    n, t = 7, 9
    mask = _random_mask(gen, n, t, as_bool=bool(seed % 2))
    r = torch.randn(n, t, generator=gen)
    v = torch.randn(n, t, generator=gen)
    # Garbage in the padding must be ignored (V after the last valid token is 0).
    pad = ~mask.bool()
    r[pad] = 50.0
    v[pad] = -40.0
    adv, ret = gae(r, v, mask, gamma, lam)
    ref_adv, ref_ret = ref_gae(r.tolist(), v.tolist(), mask.tolist(), gamma, [lam] * n)
    _close(adv, ref_adv)
    _close(ret, ref_ret)


@pytest.mark.parametrize("seed", SEEDS)
def test_gae_per_response_lambda_matches_reference(seed: int) -> None:
    """gae with λ given per response `[N]` uses each row's own λ."""
    gen = torch.Generator().manual_seed(1100 + seed)
    n, t = 6, 8
    mask = _random_mask(gen, n, t)
    r = torch.randn(n, t, generator=gen)
    v = torch.randn(n, t, generator=gen)
    lams = torch.rand(n, generator=gen)
    adv, ret = gae(r, v, mask, 0.97, lams)
    ref_adv, ref_ret = ref_gae(r.tolist(), v.tolist(), mask.tolist(), 0.97, lams.tolist())
    _close(adv, ref_adv)
    _close(ret, ref_ret)


@pytest.mark.parametrize("seed", SEEDS)
def test_gae_gamma_lambda_one_is_reward_to_go_minus_value(seed: int) -> None:
    """γ = λ = 1: A_t = Σ_{k≥t} r_k − V_t and return_t = Σ_{k≥t} r_k, per token."""
    gen = torch.Generator().manual_seed(1200 + seed)
    n, t = 6, 8
    mask = _random_mask(gen, n, t)
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
    _close(adv, exp_adv)
    _close(ret, exp_ret)


def test_gae_hand_example() -> None:
    """Two tokens, γ = 0.5, λ = 0.5: δ = [r0 + .5·V1 − V0, r1 − V1], A0 = δ0 + .25·δ1."""
    r = torch.tensor([[1.0, 2.0, 0.0]])
    v = torch.tensor([[0.5, 1.0, 9.0]])
    mask = torch.tensor([[1, 1, 0]])
    d0 = 1.0 + 0.5 * 1.0 - 0.5
    d1 = 2.0 - 1.0
    adv, ret = gae(r, v, mask, 0.5, 0.5)
    _close(adv, [[d0 + 0.25 * d1, d1, 0.0]], atol=1e-7, rtol=0)
    _close(ret, [[d0 + 0.25 * d1 + 0.5, d1 + 1.0, 0.0]], atol=1e-7, rtol=0)


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
        _close(out, expected, atol=1e-6, rtol=1e-6)


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
    rewards = _random_rewards(gen, n, "binary")
    values = torch.randn(n, t, generator=gen) * 0.5
    pol, tgt = vapo_advantages(rewards, values, mask)
    ml, vl = mask.tolist(), values.tolist()
    token_r = ref_outcome_token_rewards(rewards.tolist(), ml)
    lams = [ref_length_adaptive_lambda(float(sum(row))) for row in ml]
    ref_pol, _ = ref_gae(token_r, vl, ml, 1.0, lams)
    _, ref_tgt = ref_gae(token_r, vl, ml, 1.0, [1.0] * n)
    _close(pol, ref_pol)
    _close(tgt, ref_tgt)
    assert torch.isfinite(pol).all()
    assert torch.isfinite(tgt).all()
    assert torch.all(pol[1] == 0.0)
    assert torch.all(tgt[1] == 0.0)


@pytest.mark.parametrize("seed", SEEDS)
def test_vapo_value_targets_are_monte_carlo_outcome(seed: int) -> None:
    """λ_critic = 1, γ = 1: every valid token's value target is R_i, whatever V is."""
    gen = torch.Generator().manual_seed(1400 + seed)
    n, t = 7, 12
    mask = _random_mask(gen, n, t)
    rewards = _random_rewards(gen, n, "continuous")
    values = torch.randn(n, t, generator=gen) * 3.0
    _, tgt = vapo_advantages(rewards, values, mask)
    ml, rl = mask.tolist(), rewards.tolist()
    expected = [[rl[i] if ml[i][s] else 0.0 for s in range(t)] for i in range(n)]
    _close(tgt, expected)


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
    _close(pol, ref_pol)
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
    _close(pol, [[0.7, 0.0], [-0.8, 0.0]], atol=1e-6, rtol=0)
    _close(tgt, [[1.0, 0.0], [-1.0, 0.0]], atol=1e-6, rtol=0)
