"""The policy losses an algorithm with a clipped surrogate may use (`algorithm.policy_loss`):
docs/algorithms.md, "Policy losses beyond the clipped ratio".

Each loss is a config variant that owns its parameters and its per-token surrogate ℓ_x:

    ppo_clip    r_t = exp(logp_θ − logp_prox); ℓ_t = −min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A),
                with the dual clip min(ℓ_t, −c·A) where A < 0 (PPO, DAPO's Clip-Higher)
    gspo        s_i = exp(Σ_t m·(logp_θ − logp_prox) / Σ_t m), one ratio per response;
                ℓ_i = −min(s_i·A_i, clip(s_i, 1 − ε_low, 1 + ε_high)·A_i) on each of its loss
                tokens (GSPO, Zheng et al. 2507.18071)
    gspo_token  s_{i,t} = sg[s_i]·exp(logp_θ,t − sg[logp_θ,t]): s_i in value, the token's own
                log-prob in the gradient; clipped as gspo, with A_{i,t}
    cispo       ℓ_t = −sg[clip(r_t, 1 − ε_low, 1 + ε_high)]·A_t·logp_θ,t: every token keeps its
                gradient, only its weight is bounded (MiniMax-M1, 2506.13585)
    sapo        ℓ_t = −(4/τ)·σ(τ·(r_t − 1))·A_t, τ = τ_pos where A_t > 0 else τ_neg: a soft gate,
                the plain policy gradient on-policy (SAPO, Gao et al. 2511.20347)

`policy_loss` is the one place the pieces meet: the off-policy correction's weight w and mask
(`streamrl.algorithms.correction`) multiply ℓ_x, and `aggregate` reduces w·ℓ_x over the
mini-batch's global denominators, whatever the loss. Every sum above runs over the kept tokens
(the loss mask after the correction's rejections): a rejected token neither moves s_i nor gets
a gradient, yet stays in the aggregation's denominators. With one optimiser update per batch
(logp_prox = logp_θ.detach()) every ratio is 1 in value and the losses differ only in their
gradients.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor

from streamrl.algorithms.correction_config import CorrectionConfig
from streamrl.algorithms.losses import DEFAULT_CORRECTION, Aggregation, aggregate
from streamrl.algorithms.masked import masked_mean, masked_sum, zero_outside
from streamrl.algorithms.reductions import Mean, StepMetric
from streamrl.config.base import Section

__all__ = [
    "POLICY_LOSSES",
    "CISPOLoss",
    "GSPOLoss",
    "GSPOTokenLoss",
    "PPOClipLoss",
    "PolicyLoss",
    "SAPOLoss",
    "check_loss_fields",
    "pg_loss",
    "policy_loss",
    "ppo_policy_loss",
]

Metrics = dict[str, StepMetric]


class _Loss(Section):
    """One policy loss: its parameters and its per-token surrogate."""

    aggregation: ClassVar[Aggregation | None] = None
    """The aggregation its authors define it with (a preset's choice), None: the algorithm's."""
    per_token_advantages: ClassVar[bool] = True
    """Whether it is defined for advantages that vary within a response (GAE)."""

    def surrogate(
        self, logp: Tensor, logp_prox: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, Metrics]:
        """ℓ_x `[N, T]` (before the correction's weight; any value where `mask` is 0) and its
        metrics, `Mean`s over `mask`. `logp` carries the gradient, `logp_prox` none; `mask` is
        the loss mask narrowed by the correction's rejections (the kept tokens) and
        `advantages` are 0 outside it."""
        raise NotImplementedError


class PlainGradientLoss(_Loss):
    """GPG's plain policy gradient: ℓ_t = −A_t·logp_θ,t, no ratio and no clip (not a choice of
    `algorithm.policy_loss`: GPG's own loss, `pg_loss`)."""

    def surrogate(
        self, logp: Tensor, logp_prox: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, Metrics]:
        return -advantages * zero_outside(logp.float(), mask), {}


class PPOClipLoss(_Loss):
    """The clipped token ratio (PPO, Clip-Higher, dual clip): every algorithm's default."""

    kind: Literal["ppo_clip"] = Field(
        "ppo_clip", description="The clipped token ratio (PPO, Clip-Higher, dual clip)."
    )
    clip_low: float = Field(0.2, gt=0.0, lt=1.0, description="ε_low: ratio floor is 1 − ε_low.")
    clip_high: float = Field(0.2, gt=0.0, description="ε_high: ratio ceiling is 1 + ε_high.")
    dual_clip: float | None = Field(
        None,
        gt=1.0,
        description="c of the dual clip: the loss of a negative-advantage token is at most "
        "−c·A. null disables.",
    )

    def surrogate(
        self, logp: Tensor, logp_prox: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, Metrics]:
        log_ratio = _log_ratio(logp, logp_prox, mask)
        ratio = torch.exp(log_ratio)
        unclipped = -advantages * ratio
        clipped = -advantages * ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
        clip_taken = clipped > unclipped
        per_token = torch.where(clip_taken, clipped, unclipped)
        dual_taken = torch.zeros_like(clip_taken)
        if self.dual_clip is not None:
            bound = -self.dual_clip * advantages
            dual_taken = (advantages < 0) & (per_token > bound)
            per_token = torch.where(dual_taken, bound, per_token)
        return per_token, {
            "actor/clip_frac": _kept_mean(clip_taken, mask),
            "actor/dual_clip_frac": _kept_mean(dual_taken, mask),
        }


class GSPOLoss(_Loss):
    """GSPO: one length-normalised ratio per response, clipped per response."""

    kind: Literal["gspo"] = Field(
        "gspo", description="GSPO: one length-normalised ratio per response, clipped per response."
    )
    clip_low: float = Field(
        3e-4, gt=0.0, lt=1.0, description="ε_low of the sequence ratio (the paper's 3e-4)."
    )
    clip_high: float = Field(
        4e-4, gt=0.0, description="ε_high of the sequence ratio (the paper's 4e-4)."
    )

    aggregation: ClassVar[Aggregation | None] = "seq-mean-token-mean"
    per_token_advantages: ClassVar[bool] = False

    def surrogate(
        self, logp: Tensor, logp_prox: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, Metrics]:
        seq_ratio = torch.exp(_sequence_log_ratio(logp, logp_prox, mask))  # [N, 1]
        return self._clipped(seq_ratio.expand_as(mask), seq_ratio, advantages, mask)

    def _clipped(
        self, ratio: Tensor, seq_ratio: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, Metrics]:
        """−min(ratio·A, clip(ratio)·A) per token; clip_frac: responses whose s_i lies outside
        the band, weighted by their loss tokens."""
        unclipped = -advantages * ratio
        clipped = -advantages * ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
        per_token = torch.where(clipped > unclipped, clipped, unclipped)
        s = seq_ratio.detach()
        outside = ((s < 1.0 - self.clip_low) | (s > 1.0 + self.clip_high)).float()
        return per_token, {
            "actor/clip_frac": _kept_mean(outside.expand_as(mask), mask),
            "actor/seq_ratio_mean": _kept_mean(s.expand_as(mask), mask),
        }


class GSPOTokenLoss(GSPOLoss):
    """GSPO-token: GSPO's ratio in value, each token's own log-prob in the gradient, so
    advantages may differ per token."""

    kind: Literal["gspo_token"] = Field(
        "gspo_token",
        description="GSPO-token: GSPO's ratio in value, each token's log-prob in the gradient.",
    )  # type: ignore[assignment]

    per_token_advantages: ClassVar[bool] = True

    def surrogate(
        self, logp: Tensor, logp_prox: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, Metrics]:
        seq_ratio = torch.exp(_sequence_log_ratio(logp, logp_prox, mask)).detach()
        own = zero_outside(logp.float() - logp.detach().float(), mask)
        return self._clipped(seq_ratio * torch.exp(own), seq_ratio, advantages, mask)


class CISPOLoss(_Loss):
    """CISPO: the token ratio, clipped and detached, weighs REINFORCE's A·logp_θ."""

    kind: Literal["cispo"] = Field(
        "cispo", description="CISPO: REINFORCE weighted by the clipped, detached token ratio."
    )
    clip_low: float = Field(
        1.0, gt=0.0, le=1.0, description="ε_low: the weight's floor is 1 − ε_low (1: none)."
    )
    clip_high: float = Field(
        0.28, gt=0.0, description="ε_high: the weight's ceiling is 1 + ε_high."
    )

    aggregation: ClassVar[Aggregation | None] = "token-mean"

    def surrogate(
        self, logp: Tensor, logp_prox: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, Metrics]:
        ratio = torch.exp(_log_ratio(logp, logp_prox, mask)).detach()
        weight = ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
        truncated = (weight != ratio).float()
        return -weight * advantages * zero_outside(logp.float(), mask), {
            "actor/clip_frac": _kept_mean(truncated, mask)
        }


class SAPOLoss(_Loss):
    """SAPO: a sigmoid gate on the ratio, steeper for negative advantages."""

    kind: Literal["sapo"] = Field("sapo", description="SAPO: a sigmoid gate on the token ratio.")
    tau_pos: float = Field(1.0, gt=0.0, description="τ where the advantage is positive.")
    tau_neg: float = Field(1.05, gt=0.0, description="τ where it is zero or negative.")

    aggregation: ClassVar[Aggregation | None] = "seq-mean-token-mean"

    def surrogate(
        self, logp: Tensor, logp_prox: Tensor, advantages: Tensor, mask: Tensor
    ) -> tuple[Tensor, Metrics]:
        ratio = torch.exp(_log_ratio(logp, logp_prox, mask))
        tau = torch.where(advantages > 0, self.tau_pos, self.tau_neg)
        gate = torch.sigmoid(tau * (ratio - 1.0))
        weight = (4.0 * gate * (1.0 - gate)).detach()  # d f / d r: 1 on-policy
        return -(4.0 / tau) * gate * advantages, {
            "actor/gate_weight_mean": _kept_mean(weight, mask)
        }


PolicyLoss = Annotated[
    PPOClipLoss | GSPOLoss | GSPOTokenLoss | CISPOLoss | SAPOLoss, Field(discriminator="kind")
]
POLICY_LOSSES: dict[str, type[_Loss]] = {
    cls.model_fields["kind"].default: cls
    for cls in (PPOClipLoss, GSPOLoss, GSPOTokenLoss, CISPOLoss, SAPOLoss)
}


def check_loss_fields(data: Any) -> Any:
    """`algorithm.policy_loss` as given, refusing a field of another loss with where it
    belongs (pydantic's own message would only say it is not permitted)."""
    if not isinstance(data, dict):
        return data
    kind = data.get("kind", "ppo_clip")
    if kind not in POLICY_LOSSES:
        return data  # the discriminator names the kinds
    own = POLICY_LOSSES[kind].model_fields
    for name in data:
        if name in own:
            continue
        homes = [k for k, cls in POLICY_LOSSES.items() if name in cls.model_fields]
        if homes:
            raise ValueError(
                f"algorithm.policy_loss.{name} is a parameter of policy_loss kind "
                f"{' / '.join(homes)}, not of {kind}; set policy_loss.kind to one of them "
                f"or drop {name}"
            )
    return data


def _kept_mean(x: Tensor, kept: Tensor) -> Mean:
    """The mean of `x` over the kept tokens, reduced exactly over the step (a plain scalar
    would be weighted by the micro-batch's loss tokens, rejected ones included)."""
    return Mean(masked_sum(x.float(), kept).detach(), kept.float().sum().detach())


def _log_ratio(logp: Tensor, logp_prox: Tensor, mask: Tensor) -> Tensor:
    """log r_t, 0 outside `mask` (padding may hold any value; selecting, not multiplying,
    keeps exp() and its gradient finite)."""
    return zero_outside(logp.float() - logp_prox.detach().float(), mask)


def _sequence_log_ratio(logp: Tensor, logp_prox: Tensor, mask: Tensor) -> Tensor:
    """`[N, 1]` log s_i: the mean log-ratio over each response's tokens in `mask` (the kept
    loss tokens; 0 for a response without any: it carries no loss)."""
    tokens = mask.sum(-1, keepdim=True)
    return _log_ratio(logp, logp_prox, mask).sum(-1, keepdim=True) / tokens.clamp(min=1.0)


def policy_loss(
    loss: _Loss,
    logp: Tensor,
    logp_prox: Tensor,
    logp_behav: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    correction: CorrectionConfig = DEFAULT_CORRECTION,
    weight_mean: float | Tensor | None = None,
    aggregation: Aggregation = "token-mean",
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    max_len: int | None = None,
) -> tuple[Tensor, Metrics]:
    """`loss`'s term of one micro-batch, its exact share of the mini-batch's: ℓ = w·ℓ_x,
    aggregated (`streamrl.algorithms.losses.aggregate`; tensors `[N, T]`, as
    `ppo_policy_loss`). Metrics: the loss's own (over the kept tokens), actor/pg_loss,
    actor/ppo_kl (logp_prox − logp_θ, over the loss tokens) and the correction's."""
    mask = mask.float()
    corrected = correction.apply(logp_prox, logp_behav, mask, weight_mean)
    kept, metrics = corrected.mask, corrected.metrics
    weights = zero_outside(corrected.weights, kept)
    # The surrogate sees the kept tokens only: a token rejected by the correction (a band,
    # IcePop, the veto) must not move GSPO's sequence ratio s_i, which would give it a
    # gradient through its response's other tokens. The aggregation keeps the full loss mask:
    # rejected tokens stay in the denominators (streamrl.algorithms.losses).
    per_token, own = loss.surrogate(logp, logp_prox, zero_outside(advantages, kept), kept)
    total = aggregate(
        weights * zero_outside(per_token, mask),
        mask,
        aggregation,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        max_len=max_len,
    )
    metrics.update(own)
    metrics["actor/pg_loss"] = total.detach()
    metrics["actor/ppo_kl"] = masked_mean(-_log_ratio(logp, logp_prox, mask), mask).detach()
    return total, metrics


def ppo_policy_loss(
    logp: Tensor,
    logp_prox: Tensor,
    logp_behav: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
    **aggregation: Any,
) -> tuple[Tensor, Metrics]:
    """`policy_loss` with the clipped token ratio (`PPOClipLoss`).

    Args:
        logp: `[N, T]` log π_θ of the sampled tokens, with grad.
        logp_prox: `[N, T]` log π_prox (weights at the start of the step), no grad.
        logp_behav: `[N, T]` log π_behav stored by the generator, or None (on-policy).
        advantages: `[N, T]` per-token advantages.
        mask: `[N, T]` loss mask: sampled tokens (never environment tokens of a multi-turn
            response), overlong filtering already applied.
        clip_low, clip_high, dual_clip: ε_low, ε_high and c (None: no dual clip).
        aggregation: `policy_loss`'s keywords (correction, weight_mean, aggregation and the
            global denominators).

    Metrics: actor/pg_loss, actor/clip_frac (kept tokens where the clipped branch is taken),
    actor/dual_clip_frac, actor/ppo_kl and the correction's.
    """
    loss = PPOClipLoss(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
    return policy_loss(loss, logp, logp_prox, logp_behav, advantages, mask, **aggregation)


def pg_loss(
    logp: Tensor,
    logp_prox: Tensor,
    logp_behav: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    **aggregation: Any,
) -> tuple[Tensor, Metrics]:
    """`policy_loss` with GPG's plain policy gradient: ℓ = −w·A·logp_θ. GPG itself is
    on-policy; the correction's weight w is the streaming system's correction for stale
    behaviour data (1 when `logp_behav` is None). Metrics: actor/pg_loss, actor/ppo_kl and the
    correction's."""
    loss = PlainGradientLoss()
    return policy_loss(loss, logp, logp_prox, logp_behav, advantages, mask, **aggregation)
