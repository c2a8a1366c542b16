"""Reward shaping: rule-reward scaling, DAPO overlong reward shaping and overlong filtering.

DAPO (Yu et al., arXiv 2503.14476), §3.4:

* The rule reward is +1 for a correct final answer and −1 otherwise; 0/1 is also offered.
* Soft overlong punishment (eq. 13), added to the rule reward, with L_max the maximum response
  length and L_cache the soft buffer:

      R_len(|o|) = 0                                   if |o| ≤ L_max − L_cache
                 = ((L_max − L_cache) − |o|) / L_cache  if L_max − L_cache < |o| ≤ L_max
                 = −1                                  if |o| > L_max

* Overlong filtering: truncated responses are masked out of the loss (they still count in
  rollout metrics).

|o| counts the tokens the policy sampled: a multi-turn response's environment tokens (tool
results, user turns) are not its length (ALGORITHMS.md "Multi-turn rollouts").

The generator applies these when it scores a group; the learner only sees shaped rewards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = [
    "RewardScale",
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
    if loss_masks is not None:
        sizes = [len(m) for m in loss_masks]
        if sizes != [int(n) for n in lengths]:
            raise ValueError(f"loss masks of {sizes} tokens for responses of {lengths.tolist()}")
        lengths = sampled_lengths(loss_masks)
    lengths = lengths.float()
    soft_start = max_len - cache_len
    ramp = (soft_start - lengths) / cache_len
    penalty = torch.where(lengths <= soft_start, torch.zeros_like(lengths), ramp)
    return torch.where(lengths > max_len, torch.full_like(lengths, -1.0), penalty)


def overlong_filter_mask(mask: Tensor, truncated: Tensor) -> Tensor:
    """Drop truncated responses from the loss: m ← m · (1 − truncated).

    Args:
        mask: `[N, T]` sampled-token mask.
        truncated: `[N]` bool, True where generation hit max_tokens without finishing.

    Returns `[N, T]` mask of the same dtype as `mask`.
    """
    keep = (~truncated.bool()).unsqueeze(-1)
    return mask * keep.to(mask.dtype)
