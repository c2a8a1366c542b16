"""Outcome-reward advantages (`streamrl.algorithms.outcome`): GRPO, Dr. GRPO, RLOO and GPG
(DAPO uses GRPO's), each against a loop reference on ragged, shuffled groups; the special
cases (all-equal groups, groups of one); DAPO's dynamic-sampling filter `groups_with_signal`;
and how a response's advantage or reward is laid onto its tokens.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from streamrl.algorithms.advantages import (
    broadcast_to_tokens,
    dr_grpo_advantages,
    gpg_advantages,
    groups_with_signal,
    grpo_advantages,
    outcome_token_rewards,
    rloo_advantages,
)
from tests.unit.algorithms.advantage_reference import (
    SEEDS,
    close,
    group_members,
    random_group_index,
    random_mask,
    random_rewards,
    ref_outcome_token_rewards,
)


def ref_grpo(rewards: list[float], group_index: list[int], eps: float = 1e-6) -> list[float]:
    members = group_members(group_index)
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
    members = group_members(group_index)
    out = []
    for i, g in enumerate(group_index):
        mean = statistics.fmean(rewards[j] for j in members[g])
        out.append(rewards[i] - mean)
    return out


def ref_rloo(rewards: list[float], group_index: list[int]) -> list[float]:
    members = group_members(group_index)
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
    members = group_members(group_index)
    return [len({rewards[i] for i in members.get(g, [])}) > 1 for g in range(num_groups)]


def ref_gpg(
    rewards: list[float], group_index: list[int], num_groups: int
) -> tuple[list[float], float]:
    members = group_members(group_index)
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


def ref_broadcast(adv: list[float], mask: list[list[float]]) -> list[list[float]]:
    return [[adv[i] if mask[i][t] else 0.0 for t in range(len(mask[i]))] for i in range(len(adv))]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", ["binary", "continuous"])
def test_grpo_matches_reference(seed: int, kind: str) -> None:
    """GRPO: (R − mean_g)/(std_g + 1e-6) with unbiased std; G = 1 → 0."""
    gen = torch.Generator().manual_seed(300 + seed)
    num_groups = 7
    gi = random_group_index(gen, num_groups)
    rewards = random_rewards(gen, gi.numel(), kind)
    out = grpo_advantages(rewards, gi, num_groups)
    assert out.dtype == torch.float32
    close(out, ref_grpo(rewards.tolist(), gi.tolist()))


def test_grpo_std_is_unbiased_hand_example() -> None:
    """R = [1, 0, 0, 0]: mean 0.25, unbiased std 0.5 → A = [1.5, −0.5, −0.5, −0.5]/(1 + 2e-6)."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    gi = torch.zeros(4, dtype=torch.int64)
    std = 0.5
    expected = [0.75 / (std + 1e-6)] + [-0.25 / (std + 1e-6)] * 3
    close(grpo_advantages(rewards, gi, 1), expected, atol=1e-6, rtol=1e-6)
    # The biased (population) std would be sqrt(3)/4 and give 1.732 for the first response.
    assert abs(grpo_advantages(rewards, gi, 1)[0].item() - 0.75 / (math.sqrt(3) / 4)) > 0.1


@pytest.mark.parametrize("seed", SEEDS)
def test_grpo_uses_torch_std_per_group(seed: int) -> None:
    """GRPO denominators are torch.std of each group (unbiased) plus 1e-6."""
    gen = torch.Generator().manual_seed(350 + seed)
    gi = random_group_index(gen, 5)
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
    gi = random_group_index(gen, 6)
    rewards = random_rewards(gen, gi.numel(), kind)
    close(dr_grpo_advantages(rewards, gi, 6), ref_dr_grpo(rewards.tolist(), gi.tolist()))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", ["binary", "continuous"])
def test_rloo_matches_reference(seed: int, kind: str) -> None:
    """RLOO: A_i = R_i − Σ_{j≠i} R_j / (G − 1); G = 1 → 0."""
    gen = torch.Generator().manual_seed(500 + seed)
    gi = random_group_index(gen, 6)
    rewards = random_rewards(gen, gi.numel(), kind)
    close(rloo_advantages(rewards, gi, 6), ref_rloo(rewards.tolist(), gi.tolist()))


@pytest.mark.parametrize("seed", SEEDS)
def test_rloo_is_scaled_mean_centred_reward(seed: int) -> None:
    """RLOO = G/(G − 1) · (R − mean_g R) for every group with G ≥ 2."""
    gen = torch.Generator().manual_seed(550 + seed)
    gi = random_group_index(gen, 6)
    rewards = random_rewards(gen, gi.numel(), "continuous")
    out = rloo_advantages(rewards, gi, 6)
    members = group_members(gi.tolist())
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
    gi = random_group_index(gen, num_groups - 1, max_size=4)
    rewards = random_rewards(gen, gi.numel(), kind)
    # Force one multi-response zero-variance group so that M ≥ 2 (group 0 is a singleton), and
    # append one informative group so that M < B.
    rewards[gi == 1] = 1.0
    gi = torch.cat([gi, torch.tensor([num_groups - 1] * 2)])
    rewards = torch.cat([rewards, torch.tensor([1.0, -1.0])])
    adv, alpha = gpg_advantages(rewards, gi, num_groups)
    ref_adv, ref_alpha = ref_gpg(rewards.tolist(), gi.tolist(), num_groups)
    assert alpha.item() == pytest.approx(ref_alpha, rel=1e-6)
    assert ref_alpha > 1.0
    close(adv, ref_adv)


def test_gpg_alpha_hand_example() -> None:
    """B = 4 groups, M = 2 zero-variance ([1, 1] and a singleton) → α = 4/2 = 2."""
    gi = torch.tensor([0, 1, 0, 2, 1, 3, 3], dtype=torch.int64)
    rewards = torch.tensor([1.0, 1.0, -1.0, 0.5, 1.0, 0.0, 1.0])
    adv, alpha = gpg_advantages(rewards, gi, 4)
    assert alpha.item() == pytest.approx(2.0)
    close(adv, [2.0, 0.0, -2.0, 0.0, 0.0, -1.0, 1.0], atol=1e-6, rtol=1e-6)


def test_gpg_counts_groups_without_signal_on_correctness_not_shaped_rewards() -> None:
    """Group 0 is all wrong, its rewards differ only by an overlong penalty: no signal, so
    M = 1 and α = 2 (counting it on the rewards would give α = 1)."""
    gi = torch.tensor([0, 0, 1, 1], dtype=torch.int64)
    scores = torch.tensor([0.0, 0.0, 1.0, 0.0])
    rewards = torch.tensor([-1.0, -1.25, 1.0, -1.0])
    adv, alpha = gpg_advantages(rewards, gi, 2, scores)
    assert alpha.item() == pytest.approx(2.0)
    close(adv, [0.25, -0.25, 2.0, -2.0], atol=1e-6, rtol=1e-6)
    assert gpg_advantages(rewards, gi, 2)[1].item() == pytest.approx(1.0)


def test_gpg_alpha_is_one_when_every_group_has_zero_variance() -> None:
    """M = B → α = 1 (documented departure) and every advantage is 0, no NaN/inf."""
    gi = torch.tensor([0, 0, 1, 2, 2, 2], dtype=torch.int64)
    rewards = torch.tensor([1.0, 1.0, -1.0, 0.7, 0.7, 0.7])
    adv, alpha = gpg_advantages(rewards, gi, 3)
    assert alpha.item() == 1.0
    assert torch.isfinite(adv).all()
    close(adv, [0.0] * 6, atol=1e-6, rtol=0)


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
    close(out[:G], [0.0] * G, atol=1e-5, rtol=0)


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
    close(grpo_advantages(rewards, gi, 1), [c / (std + 1e-6) for c in centred])
    close(dr_grpo_advantages(rewards, gi, 1), centred)
    close(rloo_advantages(rewards, gi, 1), [1.0, -0.5, -0.5])
    adv, alpha = gpg_advantages(rewards, gi, 1)
    assert alpha.item() == 1.0
    close(adv, centred)


@pytest.mark.parametrize("seed", SEEDS)
def test_groups_with_signal_matches_reference(seed: int) -> None:
    """groups_with_signal[g] is True iff the rewards of group g are not all equal."""
    gen = torch.Generator().manual_seed(700 + seed)
    gi = random_group_index(gen, 10, max_size=4)
    rewards = random_rewards(gen, gi.numel(), "binary")
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
    mask = random_mask(gen, 6, 7, as_bool=bool(seed % 2))
    close(broadcast_to_tokens(adv, mask), ref_broadcast(adv.tolist(), mask.tolist()))


@pytest.mark.parametrize("seed", SEEDS)
def test_outcome_token_rewards_matches_reference(seed: int) -> None:
    """outcome_token_rewards places R_i on the last valid token only (0 on empty rows)."""
    gen = torch.Generator().manual_seed(800 + seed)
    rewards = torch.randn(7, generator=gen)
    mask = random_mask(gen, 7, 9, as_bool=bool(seed % 2))
    out = outcome_token_rewards(rewards, mask)
    close(out, ref_outcome_token_rewards(rewards.tolist(), mask.tolist()))


def test_outcome_token_rewards_hand_example() -> None:
    """Lengths 3, 1, 0, 4 in T = 4: R lands at columns 2, 0, nowhere, 3."""
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    out = outcome_token_rewards(torch.tensor([2.0, -1.0, 5.0, 0.5]), mask)
    expected = [[0, 0, 2.0, 0], [-1.0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0.5]]
    close(out, expected, atol=0, rtol=0)
