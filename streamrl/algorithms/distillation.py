"""On-policy distillation (docs/algorithms.md, "On-policy distillation"): a teacher's log-probs
on the student's own samples as a dense per-token advantage, beside or instead of the outcome
advantage.

The generator has the teacher score every sampled token of each episode's exact token history
(`streamrl.scorers`); the record carries those log-probs (`ScoredGroup.teacher_logprobs`), so the
learner needs no teacher. Per token, with m the loss mask:

    d_t = logp_T,t − logp_behav,t                     (minus the reverse-KL sample estimate)
    A_t = λ_rl · A_outcome + λ_opd · Σ_{k≥t} γ^{k−t} · m_k · d_k

`A_outcome` is the configured algorithm's advantage after its own normalisation; d is never
normalised by the group or batch statistics of the outcome advantages. γ = 0 (default) makes
the return d_t itself.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from streamrl.config.base import Section

__all__ = ["OPDConfig", "distillation_returns", "opd_metric_sums"]


class OPDConfig(Section):
    """On-policy distillation's weights (`algorithm.opd`): the per-token advantage
    λ_rl·A + λ_opd·Σ_{k≥t} γ^{k−t}·m_k·(logp_T − logp_behav)_k. Needs a teacher
    (`generator.teacher`)."""

    lambda_rl: float = Field(
        1.0,
        ge=0.0,
        description="λ_rl, the weight of the algorithm's outcome advantage; 0: pure "
        "distillation (the reward is then logged but not trained on).",
    )
    lambda_opd: float = Field(
        1.0, gt=0.0, description="λ_opd, the weight of the distillation advantage."
    )
    gamma: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="γ_opd, the discount of the distillation return; 0 (default): each token's "
        "own log-prob gap, as in the on-policy distillation recipe.",
    )

    def advantages(
        self, outcome: Tensor, teacher: Tensor, behaviour: Tensor, mask: Tensor
    ) -> Tensor:
        """λ_rl · `outcome` + λ_opd · the distillation returns, `[n, T]` float32, zero off
        `mask`."""
        returns = distillation_returns(teacher, behaviour, mask, self.gamma)
        return (self.lambda_rl * outcome.float() + self.lambda_opd * returns) * mask


def distillation_returns(teacher: Tensor, behaviour: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Σ_{k≥t} γ^{k−t} · m_k · (teacher_k − behaviour_k) along each row, `[n, T]` float32, zero
    off `mask`.

    Positions off the mask (prompt, padding, environment tokens of a multi-turn response) add
    nothing but still count in the exponent k − t: γ discounts by position. A reverse scan over
    T (vectorised over the rows) when γ > 0."""
    mask = mask.float()
    gaps = (teacher.float() - behaviour.float()) * mask
    if gamma == 0.0:
        return gaps
    returns = torch.zeros_like(gaps)
    running = torch.zeros(gaps.shape[0], dtype=gaps.dtype, device=gaps.device)
    for t in reversed(range(gaps.shape[1])):
        running = gaps[:, t] + gamma * running
        returns[:, t] = running
    return returns * mask


def opd_metric_sums(teacher: Tensor, behaviour: Tensor, mask: Tensor) -> Tensor:
    """`[3]` float64: Σ m·(logp_behav − logp_T) (the student's reverse KL to the teacher on its
    own samples, summed), Σ m·logp_T and Σ m, over the loss tokens — summed over micro-batches
    and ranks, then divided into `opd/reverse_kl` and `opd/teacher_logp_mean`."""
    mask = mask.double()
    teacher, behaviour = teacher.double(), behaviour.double()
    return torch.stack([((behaviour - teacher) * mask).sum(), (teacher * mask).sum(), mask.sum()])
