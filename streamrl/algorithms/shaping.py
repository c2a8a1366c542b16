"""Reward shaping: rule-reward scaling, DAPO overlong reward shaping and overlong filtering,
and the framework guide's adaptive length penalty.

DAPO (Yu et al., arXiv 2503.14476), §3.4:

* The rule reward is +1 for a correct final answer and −1 otherwise; 0/1 is also offered.
* Soft overlong punishment (eq. 13), added to the rule reward, with L_max the maximum response
  length and L_cache the soft buffer:

      R_len(|o|) = 0                                   if |o| ≤ L_max − L_cache
                 = ((L_max − L_cache) − |o|) / L_cache  if L_max − L_cache < |o| ≤ L_max
                 = −1                                  if |o| > L_max

* Overlong filtering: truncated responses are masked out of the loss (they still count in
  rollout metrics).

Adaptive length penalty (the unified GRPO/DAPO/VAPO framework guide, eqs 31–33), an alternative
to the overlong punishment that acts at every length rather than near L_max, and harder on wrong
answers than on correct ones, with R_base the rule reward and r_th a reward threshold:

    R = R_base − λ(R_base)·pen(|o|, R_base)
    pen = a·ln(1 + |o|/L_target)   if R_base > r_th      (eq 32)
        = b·(|o|/L_target)²        otherwise
    λ(r) = λ_base·exp(−γ·max(0, r − r_th))               (eq 33)

|o| counts the tokens the policy sampled: a multi-turn response's environment tokens (tool
results, user turns) are not its length (docs/algorithms.md "Multi-turn rollouts").

The generator applies these when it scores a group; the learner only sees shaped rewards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = [
    "RewardScale",
    "adaptive_length_penalty",
    "overlong_filter_mask",
    "overlong_penalty",
    "sampled_lengths",
    "scale_rule_reward",
]

RewardScale = Literal["plus_minus_one", "zero_one"]


def scale_rule_reward(correct: Tensor, scale: RewardScale = "plus_minus_one") -> Tensor:
    """Map a verifier's correctness to the rule reward.

    Args:
        correct: `[N]` bool, or float in [0, 1] (a partial score is mapped linearly).
        scale: "plus_minus_one" → correct +1 / incorrect −1 (DAPO); "zero_one" → 1 / 0.

    Returns `[N]` float32.
    """
    score = correct.float()
    if scale == "plus_minus_one":
        return 2.0 * score - 1.0
    if scale == "zero_one":
        return score
    raise ValueError(f"unknown reward scale {scale!r}; use 'plus_minus_one' or 'zero_one'")


def sampled_lengths(loss_masks: Sequence[Any]) -> Tensor:
    """|o| of each response: its sampled tokens, the ones of its loss mask.

    `loss_masks`: N arrays `[L_i]` (numpy or torch), 1 at a sampled token, 0 at an environment
    token → `[N]` int64.
    """
    return torch.tensor(
        [int(torch.count_nonzero(torch.as_tensor(m))) for m in loss_masks], dtype=torch.int64
    )


def overlong_penalty(
    lengths: Tensor, max_len: int, cache_len: int, *, loss_masks: Sequence[Any] | None = None
) -> Tensor:
    """DAPO soft overlong punishment R_len (eq. 13), to be *added* to the rule reward.

    Args:
        lengths: `[N]` response lengths in tokens (int or float): |o| itself for single-turn
            responses, whose every token was sampled.
        max_len: L_max, the maximum response length (the generator's max_tokens).
        cache_len: L_cache, the soft buffer; 0 < L_cache ≤ L_max.
        loss_masks: multi-turn responses' loss masks, N arrays `[lengths[i]]` with 1 at a
            sampled token: |o| counts those only (`sampled_lengths`), never environment
            tokens. None: single-turn.

    Returns `[N]` float32 in [−1, 0].
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(f"overlong cache_len must be in (0, max_len={max_len}], got {cache_len}")
    lengths = _sampled(lengths, loss_masks)
    soft_start = max_len - cache_len
    ramp = (soft_start - lengths) / cache_len
    penalty = torch.where(lengths <= soft_start, torch.zeros_like(lengths), ramp)
    return torch.where(lengths > max_len, torch.full_like(lengths, -1.0), penalty)


def adaptive_length_penalty(
    rewards: Tensor,
    lengths: Tensor,
    *,
    target: int,
    a: float,
    b: float,
    r_th: float,
    lambda_base: float,
    gamma: float,
    loss_masks: Sequence[Any] | None = None,
) -> Tensor:
    """The adaptive length penalty −λ(R_base)·pen(|o|, R_base) (framework guide eqs 31–33), to
    be *added* to the rule reward (so the shaped reward is eq 31's R).

    Args:
        rewards: `[N]` R_base, the rule rewards (`scale_rule_reward`): they pick the branch of
            eq 32 (log above r_th, quadratic at or below it) and the weight λ of eq 33.
        lengths: `[N]` response lengths in tokens, as for `overlong_penalty`.
        target: L_target > 0 in tokens.
        a, b: scales of the logarithmic (R_base > r_th) and quadratic penalties.
        r_th: the reward threshold.
        lambda_base, gamma: λ(r) = λ_base·exp(−γ·max(0, r − r_th)).
        loss_masks: multi-turn responses' loss masks, as for `overlong_penalty`: |o| counts
            sampled tokens only. None: single-turn.

    Returns `[N]` float32, ≤ 0 for non-negative a, b, λ_base; 0 for an empty response.
    """
    if target <= 0:
        raise ValueError(f"length penalty target must be > 0 tokens, got {target}")
    relative = _sampled(lengths, loss_masks) / target
    rewards = rewards.float()
    pen = torch.where(rewards > r_th, a * torch.log1p(relative), b * relative.square())
    weight = lambda_base * torch.exp(-gamma * (rewards - r_th).clamp(min=0.0))
    return -(weight * pen)


def _sampled(lengths: Tensor, loss_masks: Sequence[Any] | None) -> Tensor:
    """`[N]` float32 |o|: `lengths`, or the sampled tokens of `loss_masks` (which must be
    `lengths` long) when given."""
    if loss_masks is None:
        return lengths.float()
    sizes = [len(m) for m in loss_masks]
    if sizes != [int(n) for n in lengths]:
        raise ValueError(f"loss masks of {sizes} tokens for responses of {lengths.tolist()}")
    return sampled_lengths(loss_masks).float()


def overlong_filter_mask(mask: Tensor, truncated: Tensor) -> Tensor:
    """Drop truncated responses from the loss: m ← m · (1 − truncated).

    Args:
        mask: `[N, T]` sampled-token mask.
        truncated: `[N]` bool, True where generation hit max_tokens without finishing.

    Returns `[N, T]` mask of the same dtype as `mask`.
    """
    keep = (~truncated.bool()).unsqueeze(-1)
    return mask * keep.to(mask.dtype)
