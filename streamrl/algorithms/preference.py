"""Preference optimization losses: DPO (with label smoothing), IPO and SimPO, per pair.

The math is ALGORITHMS.md "Preference optimization". A pair is a prompt x with a chosen response
y_w and a rejected one y_l; the inputs are sequence log-probs summed over each response's loss
tokens (logπ(y|x) = Σ_t m_t·logp_t) and those tokens' counts |y|:

- `dpo`: r = β·(logπ_θ(y|x) − logπ_ref(y|x)), h = r_w − r_l,
  ℓ = −(1−ε)·log σ(h) − ε·log σ(−h)  (ε = label smoothing; 0: plain DPO);
- `ipo`: u = (logπ_θ(y_w) − logπ_ref(y_w))/|y_w| − (logπ_θ(y_l) − logπ_ref(y_l))/|y_l|,
  ℓ = (u − 1/(2β))², its implicit rewards r = (logπ_θ − logπ_ref)/|y|;
- `simpo` (no reference): r = (β/|y|)·logπ_θ(y|x), ℓ = −log σ(r_w − r_l − γ);

plus, with `nll_weight` α > 0, α·(−logπ_θ(y_w|x)/|y_w|) (RPO). `PairLoss` carries each pair's
loss and implicit rewards; the caller averages over the global pair count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor
from torch.nn.functional import logsigmoid

__all__ = ["DEFAULT_BETA", "PairLoss", "PreferenceLoss", "pair_loss", "summed_logprobs"]

PreferenceLoss = Literal["dpo", "ipo", "simpo"]
DEFAULT_BETA: dict[str, float] = {"dpo": 0.1, "ipo": 0.1, "simpo": 2.0}


@dataclass(frozen=True)
class PairLoss:
    """Per pair `[k]`: the loss ℓ, the implicit rewards of the chosen and the rejected response
    (r_w, r_l) and the margin r_w − r_l."""

    loss: Tensor
    reward_chosen: Tensor
    reward_rejected: Tensor

    @property
    def margin(self) -> Tensor:
        return self.reward_chosen - self.reward_rejected


def pair_loss(
    kind: PreferenceLoss,
    chosen: Tensor,
    rejected: Tensor,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    *,
    ref_chosen: Tensor | None = None,
    ref_rejected: Tensor | None = None,
    beta: float,
    label_smoothing: float = 0.0,
    gamma: float = 0.5,
    nll_weight: float = 0.0,
) -> PairLoss:
    """The loss of `kind` for k pairs from their summed log-probs `[k]` under the policy
    (`chosen`, `rejected`), the reference (`ref_*`, unused by simpo) and their loss-token
    counts (module docstring)."""
    n_w, n_l = chosen_tokens.clamp_min(1).to(chosen.dtype), rejected_tokens.clamp_min(1)
    n_l = n_l.to(chosen.dtype)
    if kind == "simpo":
        r_w, r_l = beta * chosen / n_w, beta * rejected / n_l
        loss = -logsigmoid(r_w - r_l - gamma)
    else:
        if ref_chosen is None or ref_rejected is None:
            raise ValueError(f"{kind} needs the reference's log-probs")
        if kind == "dpo":
            r_w, r_l = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
            h = r_w - r_l
            loss = -(1 - label_smoothing) * logsigmoid(h) - label_smoothing * logsigmoid(-h)
        elif kind == "ipo":
            r_w, r_l = (chosen - ref_chosen) / n_w, (rejected - ref_rejected) / n_l
            loss = (r_w - r_l - 1 / (2 * beta)) ** 2
        else:
            raise ValueError(f"unknown preference loss {kind!r}: dpo, ipo or simpo")
    if nll_weight:
        loss = loss + nll_weight * (-chosen / n_w)
    return PairLoss(loss, r_w.detach(), r_l.detach())


def summed_logprobs(logp: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per response `[n]`: Σ_t m_t·logp_t over its loss tokens, and their count."""
    mask = mask.bool()
    return torch.where(mask, logp, 0.0).sum(1), mask.sum(1)
