"""Off-policy correction: the weights and rejections that correct for the gap between the
behaviour policy (the generator's log-probs) and the proximal one (the learner's), ALGORITHMS.md
"Off-policy correction: the full menu".

With δ_t = logp_prox,t − logp_behav,t over loss tokens (m = 1), clamped to ±`SAFETY_BOUND`
before any exp:

    ratio level   token:      ρ_t = exp(δ_t)
                  sequence:   ρ_i = exp(Σ_t m_t·δ_t)            (every token of response i)
                  geometric:  ρ_i = exp(Σ_t m_t·δ_t / Σ_t m_t)  (1 for a response without loss
                                                                 tokens)
    weight (IS)   w = min(ρ, C_is) at `is_level` (token or sequence); none: w = 1
    rejection     m ← 0 where ρ ∉ [c_low, c_high] at `rs_level` (token, sequence, geometric)
    veto          m ← 0 on every token of a response with a token of exp(δ_t) < τ_veto, the
                  unclamped δ
    IcePop        token-level band [α, β]: m ← 0 outside it, w = ρ_t inside (no truncation)

Rejected tokens contribute 0 but stay in the loss's denominator (`streamrl.algorithms.losses`);
weights and masks are detached. A sequence-level exponent (a sum over the response) is clamped
to ±`SAFETY_BOUND` too, so no ratio overflows: e^20 lies beyond any truncation cap or band.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from streamrl.algorithms.masked import masked_mean, zero_outside

__all__ = ["SAFETY_BOUND", "Correction", "RatioLevel", "correct", "log_ratio", "ratio"]

SAFETY_BOUND = 20.0
RatioLevel = Literal["token", "sequence", "geometric"]


@dataclass(frozen=True)
class Correction:
    """`weights [N, T]` and `mask [N, T]` (the loss mask narrowed by every rejection), both
    detached, and the step's metrics of the correction."""

    weights: Tensor
    mask: Tensor
    metrics: dict[str, Tensor]


def log_ratio(logp_prox: Tensor, logp_behav: Tensor | None, mask: Tensor) -> Tensor:
    """δ = logp_prox − logp_behav, detached, 0 outside the loss mask (`logp_behav=None`:
    on-policy, δ = 0). Not clamped: `ratio` clamps."""
    if logp_behav is None:
        return torch.zeros_like(mask, dtype=torch.float32)
    delta = logp_prox.detach().float() - logp_behav.detach().float()
    return zero_outside(delta, mask)


def ratio(delta: Tensor, mask: Tensor, level: RatioLevel) -> Tensor:
    """ρ at `level` for every token `[N, T]` (a response's ratio repeated over its tokens)."""
    mask = mask.float()
    if level == "token":
        exponent = delta
    elif level in ("sequence", "geometric"):
        total = zero_outside(delta.clamp(-SAFETY_BOUND, SAFETY_BOUND), mask).sum(-1)
        if level == "geometric":
            total = total / mask.sum(-1).clamp(min=1.0)
        exponent = total.unsqueeze(-1).expand_as(delta)
    else:
        raise ValueError(f"unknown ratio level {level!r}; use token, sequence or geometric")
    return torch.exp(exponent.clamp(-SAFETY_BOUND, SAFETY_BOUND))


def correct(
    logp_prox: Tensor,
    logp_behav: Tensor | None,
    mask: Tensor,
    *,
    is_level: Literal["token", "sequence", "none"] = "token",
    is_cap: float = 2.0,
    rs_level: RatioLevel | Literal["none"] = "none",
    rs_band: tuple[float, float] | None = None,
    veto: float | None = None,
    icepop: tuple[float, float] | None = None,
) -> Correction:
    """The correction of one micro-batch (module docstring).

    Args:
        logp_prox, logp_behav: `[N, T]` log-probs of the sampled tokens under the proximal and
            the behaviour policy; `logp_behav=None` is on-policy (every ρ = 1).
        mask: `[N, T]` the loss mask.
        is_level, is_cap: the truncated importance weight; "none": w = 1.
        rs_level, rs_band: rejection of tokens or responses whose ρ lies outside
            `rs_band = (c_low, c_high)`.
        veto: τ_veto; None: no veto.
        icepop: IcePop's band (α, β); replaces the IS weight with ρ_t inside it.

    Metrics (token means over the loss mask): actor/is_weight_mean (token ρ before any
    truncation), actor/is_clip_frac (tokens whose weight was truncated), mismatch/rs_token_frac
    (tokens rejected by the band or IcePop), mismatch/veto_frac (tokens of vetoed responses).
    """
    mask = mask.float()
    delta = log_ratio(logp_prox, logp_behav, mask)
    token_ratio = ratio(delta, mask, "token")
    keep = mask.clone()
    if icepop is not None:
        low, high = icepop
        inside = (token_ratio >= low) & (token_ratio <= high)
        weights = torch.where(inside, token_ratio, 0.0)
        clipped = torch.zeros_like(mask)
        rejected = (~inside).float()
    else:
        if is_level == "none":
            weights, clipped = torch.ones_like(mask), torch.zeros_like(mask)
        else:
            level_ratio = token_ratio if is_level == "token" else ratio(delta, mask, "sequence")
            weights = level_ratio.clamp(max=is_cap)
            clipped = (level_ratio > is_cap).float()
        rejected = torch.zeros_like(mask)
        if rs_level != "none":
            if rs_band is None:
                raise ValueError("rejection needs rs_band = (c_low, c_high)")
            low, high = rs_band
            level_ratio = ratio(delta, mask, rs_level)
            rejected = ((level_ratio < low) | (level_ratio > high)).float()
    keep = keep * (1.0 - rejected)
    vetoed = torch.zeros_like(mask)
    if veto is not None:
        catastrophic = (delta < math.log(veto)) & (mask != 0)  # δ: 0 outside the mask
        vetoed = catastrophic.any(-1, keepdim=True).float().expand_as(mask)
        keep = keep * (1.0 - vetoed)
    metrics = {
        "actor/is_weight_mean": masked_mean(token_ratio, mask).detach(),
        "actor/is_clip_frac": masked_mean(clipped, mask).detach(),
        "mismatch/rs_token_frac": masked_mean(rejected, mask).detach(),
        "mismatch/veto_frac": masked_mean(vetoed, mask).detach(),
    }
    return Correction(weights.detach(), keep.detach(), metrics)
