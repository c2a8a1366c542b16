"""Tests for `streamrl.algorithms.shaping`: rule-reward scaling, DAPO overlong reward shaping
(eq. 13), overlong filtering and the framework guide's adaptive length penalty (eqs 31–33).

Each function is compared with an independent looped reference written from docs/algorithms.md on
seeded random inputs, plus hand-computed boundary cases.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from streamrl.algorithms.shaping import (
    adaptive_length_penalty,
    overlong_filter_mask,
    overlong_penalty,
    scale_rule_reward,
)

SEEDS = [0, 1, 2, 3, 4]


# --------------------------------------------------------------------------------------------
# Reference implementations (plain Python loops)
# --------------------------------------------------------------------------------------------


def ref_overlong_penalty(lengths: list[float], max_len: int, cache_len: int) -> list[float]:
    """R_len = 0 if |o| ≤ L_max − L_cache; ((L_max − L_cache) − |o|)/L_cache if inside the
    soft buffer; −1 if |o| > L_max."""
    out = []
    for length in lengths:
        if length <= max_len - cache_len:
            out.append(0.0)
        elif length <= max_len:
            out.append(((max_len - cache_len) - length) / cache_len)
        else:
            out.append(-1.0)
    return out


def ref_filter_mask(mask: list[list[float]], truncated: list[bool]) -> list[list[float]]:
    """m ← m·(1 − truncated), row by row."""
    return [
        [0.0 if truncated[i] else float(mask[i][t]) for t in range(len(mask[i]))]
        for i in range(len(mask))
    ]


def ref_scale(scores: list[float], scale: str) -> list[float]:
    """+1 correct / −1 incorrect (linear for partial scores), or 1 / 0."""
    if scale == "plus_minus_one":
        return [-1.0 + 2.0 * s for s in scores]
    return [float(s) for s in scores]


def ref_length_penalised(
    rewards: list[float],
    sampled: list[int],
    target: int,
    a: float,
    b: float,
    r_th: float,
    lambda_base: float,
    gamma: float,
) -> list[float]:
    """Eq 31: R = R_base − λ(R_base)·pen(|o|, R_base), response by response, with |o| the
    sampled tokens; pen (eq 32) logarithmic above r_th, quadratic at or below; λ from eq 33."""
    out = []
    for reward, length in zip(rewards, sampled, strict=True):
        ratio = length / target
        pen = a * math.log(1.0 + ratio) if reward > r_th else b * ratio**2
        weight = lambda_base * math.exp(-gamma * max(0.0, reward - r_th))
        out.append(reward - weight * pen)
    return out


def _close(actual: torch.Tensor, expected, atol: float = 1e-6, rtol: float = 1e-6) -> None:
    expected_t = torch.as_tensor(expected, dtype=torch.float64).to(torch.float32)
    torch.testing.assert_close(actual.float(), expected_t, atol=atol, rtol=rtol)


# --------------------------------------------------------------------------------------------
# overlong_penalty
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("max_len", "cache_len"), [(20480, 4096), (100, 20), (64, 64), (10, 1)])
def test_overlong_penalty_matches_reference(seed: int, max_len: int, cache_len: int) -> None:
    """Random integer lengths in [0, 1.3·L_max] agree with the piecewise formula."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, int(1.3 * max_len) + 2, (64,), generator=gen)
    # Always include the three boundaries and their neighbours.
    soft = max_len - cache_len
    extra = torch.tensor([soft, soft + 1, max_len - 1, max_len, max_len + 1, 0])
    lengths = torch.cat([lengths, extra.clamp(min=0)])
    out = overlong_penalty(lengths, max_len, cache_len)
    assert out.dtype == torch.float32
    assert out.shape == lengths.shape
    _close(out, ref_overlong_penalty([float(x) for x in lengths.tolist()], max_len, cache_len))


@pytest.mark.parametrize("seed", SEEDS)
def test_overlong_penalty_float_lengths_match_reference(seed: int) -> None:
    """Non-integer lengths (e.g. averages) follow the same formula."""
    gen = torch.Generator().manual_seed(50 + seed)
    lengths = torch.rand(40, generator=gen, dtype=torch.float64) * 150.0
    out = overlong_penalty(lengths, 120, 30)
    _close(out, ref_overlong_penalty(lengths.tolist(), 120, 30), atol=1e-5)


@pytest.mark.parametrize(
    ("length", "expected"),
    [
        (0, 0.0),
        (16383, 0.0),
        (16384, 0.0),  # |o| = L_max − L_cache: last length with no penalty
        (16385, -1.0 / 4096),  # first token into the soft buffer
        (18432, -0.5),  # middle of the buffer
        (20479, -4095.0 / 4096),
        (20480, -1.0),  # |o| = L_max: ((L_max − L_cache) − L_max)/L_cache = −1
        (20481, -1.0),  # beyond L_max
        (1_000_000, -1.0),
    ],
)
def test_overlong_penalty_dapo_boundaries(length: int, expected: float) -> None:
    """DAPO defaults L_max = 20480, L_cache = 4096 at and around each boundary."""
    out = overlong_penalty(torch.tensor([length]), 20480, 4096)
    assert out.item() == pytest.approx(expected, abs=1e-7)


def test_overlong_penalty_ramp_is_linear_and_bounded() -> None:
    """Inside the buffer the penalty falls by 1/L_cache per token; everything is in [−1, 0]."""
    max_len, cache_len = 50, 10
    lengths = torch.arange(0, 80)
    out = overlong_penalty(lengths, max_len, cache_len)
    assert torch.all(out <= 0.0)
    assert torch.all(out >= -1.0)
    steps = out[41:51] - out[40:50]
    _close(steps, [-1.0 / cache_len] * 10)
    assert torch.all(out[:41] == 0.0)
    assert torch.all(out[50:] == -1.0)


def test_overlong_penalty_cache_equal_to_max_len() -> None:
    """L_cache = L_max is legal: the ramp starts at length 0 (−|o|/L_max)."""
    out = overlong_penalty(torch.tensor([0, 1, 5, 10, 11]), 10, 10)
    _close(out, [0.0, -0.1, -0.5, -1.0, -1.0])


@pytest.mark.parametrize(("max_len", "cache_len"), [(100, 0), (100, -5), (100, 101), (0, 0)])
def test_overlong_penalty_bad_cache_len_raises(max_len: int, cache_len: int) -> None:
    """cache_len outside (0, max_len] raises ValueError."""
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(torch.tensor([1, 2]), max_len, cache_len)


def test_overlong_penalty_added_to_rule_reward() -> None:
    """Shaped reward = rule reward + R_len: a correct answer 2048 tokens into the DAPO buffer
    scores 1 − 0.5 = 0.5."""
    correct = torch.tensor([True, True, False])
    lengths = torch.tensor([100, 18432, 30000])
    shaped = scale_rule_reward(correct) + overlong_penalty(lengths, 20480, 4096)
    _close(shaped, [1.0, 0.5, -2.0])


# --------------------------------------------------------------------------------------------
# adaptive_length_penalty
# --------------------------------------------------------------------------------------------


def _random_penalty_case(seed: int, scale: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Rule rewards of `scale` (correct, wrong, partial and exactly r_th), lengths 0..3·L_target,
    and random parameters."""
    gen = torch.Generator().manual_seed(300 + seed)
    # r_th inside the scale's range, on a 1/64 grid so that R_base = r_th holds in float32.
    fraction = round((0.2 + 0.6 * float(torch.rand(1, generator=gen))) * 64) / 64
    params = {
        "target": int(torch.randint(1, 400, (1,), generator=gen)),
        "a": float(torch.rand(1, generator=gen)) * 2.0,
        "b": float(torch.rand(1, generator=gen)) * 2.0,
        "r_th": fraction if scale == "zero_one" else 2.0 * fraction - 1.0,
        "lambda_base": float(torch.rand(1, generator=gen)) + 0.01,
        "gamma": float(torch.rand(1, generator=gen)) * 3.0,
    }
    scores = torch.rand(48, generator=gen)
    scores[:16] = (scores[:16] < 0.5).float()  # verifier's correct / wrong
    rewards = scale_rule_reward(scores, scale)  # type: ignore[arg-type]
    rewards[-4:] = params["r_th"]  # exactly at the threshold: the quadratic branch
    lengths = torch.randint(0, 3 * params["target"] + 2, (48,), generator=gen)
    lengths[:3] = 0
    return rewards, lengths, params


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scale", ["plus_minus_one", "zero_one"])
def test_adaptive_length_penalty_matches_reference(seed: int, scale: str) -> None:
    """R_base + the penalty equals eq 31 on random rewards either side of and exactly at r_th."""
    rewards, lengths, params = _random_penalty_case(seed, scale)
    r_th = torch.tensor(params["r_th"], dtype=torch.float32)
    assert (rewards > r_th).any()
    assert (rewards < r_th).any()
    assert (rewards == r_th).any()
    penalty = adaptive_length_penalty(rewards, lengths, **params)
    assert penalty.dtype == torch.float32
    assert penalty.shape == rewards.shape
    assert (penalty <= 0).all()
    expected = ref_length_penalised(rewards.tolist(), lengths.tolist(), **params)
    _close(rewards + penalty, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scale", ["plus_minus_one", "zero_one"])
def test_adaptive_length_penalty_hand_values(scale: str) -> None:
    """L_target = 100, a = b = 1, r_th = 0, λ_base = 0.5, γ = 2. A correct answer (R_base = 1 on
    either scale) pays 0.5·e^(−2)·ln(1 + |o|/100); a wrong one 0.5·(|o|/100)² whether R_base is
    −1 (below r_th) or 0 (at r_th)."""
    correct, wrong = scale_rule_reward(torch.tensor([True, False]), scale)  # type: ignore[arg-type]
    rewards = torch.stack([correct, correct, wrong, wrong])
    lengths = torch.tensor([100, 300, 100, 200])
    penalty = adaptive_length_penalty(
        rewards, lengths, target=100, a=1.0, b=1.0, r_th=0.0, lambda_base=0.5, gamma=2.0
    )
    decayed = 0.5 * math.exp(-2.0)
    _close(penalty, [-decayed * math.log(2.0), -decayed * math.log(4.0), -0.5, -2.0])


def test_adaptive_length_penalty_at_the_threshold_takes_the_quadratic_branch_at_full_weight():
    """R_base = r_th is not above it: b·(|o|/L)² with λ = λ_base (no decay); just above it the
    logarithmic branch with λ ≈ λ_base."""
    rewards = torch.tensor([0.5, 0.5 + 1e-3])
    penalty = adaptive_length_penalty(
        rewards,
        torch.tensor([20, 20]),
        target=10,
        a=3.0,
        b=5.0,
        r_th=0.5,
        lambda_base=0.2,
        gamma=7.0,
    )
    _close(penalty, [-0.2 * 5.0 * 4.0, -0.2 * math.exp(-7e-3) * 3.0 * math.log(3.0)])


def test_adaptive_length_penalty_is_zero_for_an_empty_response() -> None:
    """|o| = 0 costs nothing on either branch: ln(1 + 0) = 0² = 0."""
    penalty = adaptive_length_penalty(
        torch.tensor([1.0, -1.0, 0.0]),
        torch.zeros(3, dtype=torch.int64),
        target=64,
        a=2.0,
        b=2.0,
        r_th=0.0,
        lambda_base=1.0,
        gamma=0.0,
    )
    assert penalty.tolist() == [0.0, 0.0, 0.0]


def test_adaptive_length_penalty_counts_sampled_tokens_of_multi_turn_responses() -> None:
    """With loss masks |o| is the sampled tokens only: environment tokens (mask 0) add nothing;
    masks that do not match the lengths are refused."""
    masks = [
        np.array([1, 1, 0, 0, 0, 1, 1, 1], np.uint8),  # 5 sampled, 3 tool-result tokens
        np.array([0, 0, 1, 1], np.uint8),  # 2 sampled
        np.zeros(3, np.uint8),  # nothing sampled
        np.ones(6, np.uint8),  # single-turn-like: 6 sampled
    ]
    lengths = torch.tensor([len(m) for m in masks])
    rewards = torch.tensor([1.0, -1.0, -1.0, 0.0])
    params = {"target": 4, "a": 0.7, "b": 1.3, "r_th": 0.0, "lambda_base": 0.4, "gamma": 1.5}
    penalty = adaptive_length_penalty(rewards, lengths, loss_masks=masks, **params)
    expected = ref_length_penalised(rewards.tolist(), [5, 2, 0, 6], **params)
    _close(rewards + penalty, expected)
    whole = ref_length_penalised(rewards.tolist(), lengths.tolist(), **params)
    assert not torch.allclose(rewards + penalty, torch.tensor(whole))
    with pytest.raises(ValueError, match="loss masks"):
        adaptive_length_penalty(rewards, lengths + 1, loss_masks=masks, **params)


@pytest.mark.parametrize("target", [0, -3])
def test_adaptive_length_penalty_bad_target_raises(target: int) -> None:
    with pytest.raises(ValueError, match="target"):
        adaptive_length_penalty(
            torch.tensor([1.0]),
            torch.tensor([5]),
            target=target,
            a=1.0,
            b=1.0,
            r_th=0.0,
            lambda_base=0.1,
            gamma=1.0,
        )


# --------------------------------------------------------------------------------------------
# overlong_filter_mask
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32, torch.int64])
def test_overlong_filter_mask_matches_reference(seed: int, mask_dtype: torch.dtype) -> None:
    """Truncated rows become all-zero; other rows keep their (ragged) mask; dtype is kept."""
    gen = torch.Generator().manual_seed(100 + seed)
    n, t = 9, 7
    lengths = torch.randint(0, t + 1, (n,), generator=gen)
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).to(mask_dtype)
    truncated = torch.rand(n, generator=gen) < 0.4
    truncated[0], truncated[1] = True, False
    out = overlong_filter_mask(mask, truncated)
    assert out.dtype == mask_dtype
    assert out.shape == mask.shape
    expected = ref_filter_mask(mask.float().tolist(), truncated.tolist())
    _close(out.float(), expected, atol=0, rtol=0)


def test_overlong_filter_mask_hand_example() -> None:
    """Only the truncated row is zeroed; int 0/1 truncation flags work like bools."""
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    for truncated in (torch.tensor([False, True, False]), torch.tensor([0, 1, 0])):
        out = overlong_filter_mask(mask, truncated)
        _close(out, [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]], atol=0, rtol=0)
    # The input mask is not modified in place.
    _close(mask, [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], atol=0, rtol=0)


def test_overlong_filter_mask_nothing_truncated_is_identity() -> None:
    """With no truncated response the mask comes back unchanged."""
    mask = torch.tensor([[True, False], [True, True]])
    out = overlong_filter_mask(mask, torch.zeros(2, dtype=torch.bool))
    assert torch.equal(out, mask)


# --------------------------------------------------------------------------------------------
# scale_rule_reward
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scale", ["plus_minus_one", "zero_one"])
def test_scale_rule_reward_matches_reference(seed: int, scale: str) -> None:
    """Bool and partial [0, 1] scores map to 2s − 1 (plus_minus_one) or s (zero_one)."""
    gen = torch.Generator().manual_seed(200 + seed)
    correct = torch.rand(20, generator=gen) < 0.5
    out = scale_rule_reward(correct, scale)
    assert out.dtype == torch.float32
    _close(out, ref_scale([float(c) for c in correct.tolist()], scale), atol=0, rtol=0)
    partial = torch.rand(20, generator=gen)
    _close(scale_rule_reward(partial, scale), ref_scale(partial.tolist(), scale))


def test_scale_rule_reward_hand_values() -> None:
    """correct → +1 / incorrect → −1 by default (DAPO); zero_one → 1 / 0; 0.25 → −0.5."""
    correct = torch.tensor([True, False])
    _close(scale_rule_reward(correct), [1.0, -1.0], atol=0, rtol=0)
    _close(scale_rule_reward(correct, "plus_minus_one"), [1.0, -1.0], atol=0, rtol=0)
    _close(scale_rule_reward(correct, "zero_one"), [1.0, 0.0], atol=0, rtol=0)
    _close(scale_rule_reward(torch.tensor([0.25, 0.5])), [-0.5, 0.0], atol=0, rtol=0)


@pytest.mark.parametrize("scale", ["pm1", "", "ZERO_ONE", "binary"])
def test_scale_rule_reward_bad_scale_raises(scale: str) -> None:
    """An unknown scale name raises ValueError."""
    with pytest.raises(ValueError, match="reward scale"):
        scale_rule_reward(torch.tensor([True]), scale)  # type: ignore[arg-type]
