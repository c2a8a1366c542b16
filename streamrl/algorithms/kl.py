"""KL estimators against a reference policy, and the EMA reference update.

Per-token estimators of KL(π_θ ‖ π_ref) from the log-probs of sampled tokens (Schulman,
"Approximating KL divergence", 2020), with d = logp_θ − logp_ref:

    k1 = d                       unbiased, high variance, can be negative
    k2 = ½ d²                    biased, low variance
    k3 = exp(−d) − (−d) − 1      unbiased and ≥ 0 (GRPO's choice)

Used either as a loss term β·KL (GRPO) or inside the token reward (REINFORCE++). The reference
is frozen (the initial policy) or, following T1 (Hou et al., 2501.11651), an exponential moving
average of the policy: θ_ref ← τ·θ_ref + (1 − τ)·θ after each optimiser step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch
from torch import Tensor

__all__ = ["KLEstimator", "ema_update_", "kl_estimate"]

KLEstimator = Literal["k1", "k2", "k3"]


def kl_estimate(logp: Tensor, logp_ref: Tensor, estimator: KLEstimator) -> Tensor:
    """Per-token KL estimate. `logp, logp_ref: [N, T]` → `[N, T]` float32.

    Differentiable in `logp`; `logp_ref` is treated as a constant.
    """
    diff = logp.float() - logp_ref.detach().float()
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff * diff
    if estimator == "k3":
        return torch.exp(-diff) + diff - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; use k1, k2 or k3")


@torch.no_grad()
def ema_update_(reference: Iterable[Tensor], policy: Iterable[Tensor], tau: float) -> None:
    """In place: θ_ref ← τ·θ_ref + (1 − τ)·θ for matching tensors (one fused foreach op)."""
    if not 0.0 <= tau <= 1.0:
        raise ValueError(f"EMA tau must be in [0, 1], got {tau}")
    ref = list(reference)
    src = [p.detach() for p in policy]
    if len(ref) != len(src):
        raise ValueError(f"reference has {len(ref)} tensors but the policy has {len(src)}")
    torch._foreach_lerp_(ref, src, 1.0 - tau)
