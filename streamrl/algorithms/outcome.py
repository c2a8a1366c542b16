"""The outcome-advantage family: one advantage per response, from the group's rewards,
broadcast to each of its tokens.

* GRPO (Shao et al., DeepSeekMath, 2402.03300): A = (R − mean_g) / (std_g + ε), KL k3 to a
  frozen reference in the loss, seq-mean-token-mean.
* Dr. GRPO (Liu et al., 2503.20783): A = R − mean_g, seq-mean-token-sum-norm.
* DAPO (Yu et al., 2503.14476): GRPO's advantages with Clip-Higher, dual clip, dynamic
  sampling, token-mean and overlong shaping; no KL.
* RLOO (Ahmadian et al., 2402.14740): the leave-one-out baseline.
* GPG (Chu et al., 2504.02546): α·(R − mean_g), plain policy gradient (no ratio, no clip, no
  KL). Departs from the paper in one place: the importance weight of stale behaviour data
  (`pg_loss`), 1 when the data is on-policy.

The formulas and their degenerate cases: `streamrl.algorithms.advantages`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field
from torch import Tensor

from streamrl.algorithms.advantages import (
    dr_grpo_advantages,
    gpg_advantages,
    grpo_advantages,
    rloo_advantages,
)
from streamrl.algorithms.base import AlgorithmBase, ClippedAlgorithmBase
from streamrl.algorithms.losses import LossDenominators, Metrics, pg_loss

__all__ = ["DAPOConfig", "DrGRPOConfig", "GPGConfig", "GRPOConfig", "RLOOConfig"]


class GRPOConfig(ClippedAlgorithmBase):
    """GRPO (Shao et al., DeepSeekMath): group-normalised advantages, KL k3 to a frozen ref."""

    name: Literal["grpo"] = "grpo"
    paper_defaults: ClassVar[dict[str, Any]] = {
        "aggregation": "seq-mean-token-mean",
        "kl": {"estimator": "k3", "coef": 0.001, "reference": "frozen"},
    }
    std_eps: float = Field(1e-6, gt=0.0, description="ε in A = (R − mean) / (std + ε).")

    def response_outcomes(
        self, rewards: Tensor, group_index: Tensor, num_groups: int, scores: Tensor
    ) -> Tensor:
        return grpo_advantages(rewards, group_index, num_groups, eps=self.std_eps)


class DrGRPOConfig(ClippedAlgorithmBase):
    """Dr. GRPO (Liu et al., 2503.20783): no std division, constant length normaliser."""

    name: Literal["dr_grpo"] = "dr_grpo"
    paper_defaults: ClassVar[dict[str, Any]] = {"aggregation": "seq-mean-token-sum-norm"}

    def response_outcomes(
        self, rewards: Tensor, group_index: Tensor, num_groups: int, scores: Tensor
    ) -> Tensor:
        return dr_grpo_advantages(rewards, group_index, num_groups)


class DAPOConfig(ClippedAlgorithmBase):
    """DAPO (Yu et al., 2503.14476): Clip-Higher, dynamic sampling, token-mean, overlong shaping."""

    name: Literal["dapo"] = "dapo"
    paper_defaults: ClassVar[dict[str, Any]] = {
        "clip_high": 0.28,
        "dual_clip": 10.0,
        "dynamic_sampling": True,
        "overlong": {"shaping": True},
    }
    std_eps: float = Field(1e-6, gt=0.0, description="ε in A = (R − mean) / (std + ε).")

    def response_outcomes(
        self, rewards: Tensor, group_index: Tensor, num_groups: int, scores: Tensor
    ) -> Tensor:
        """GRPO's group-normalised advantages (dynamic sampling happens in the collector)."""
        return grpo_advantages(rewards, group_index, num_groups, eps=self.std_eps)


class RLOOConfig(ClippedAlgorithmBase):
    """RLOO (Ahmadian et al., 2402.14740): leave-one-out baseline."""

    name: Literal["rloo"] = "rloo"

    def response_outcomes(
        self, rewards: Tensor, group_index: Tensor, num_groups: int, scores: Tensor
    ) -> Tensor:
        return rloo_advantages(rewards, group_index, num_groups)


class GPGConfig(AlgorithmBase):
    """GPG (Chu et al., 2504.02546): plain policy gradient with the α = B/(B − M) correction."""

    name: Literal["gpg"] = "gpg"

    def response_outcomes(
        self, rewards: Tensor, group_index: Tensor, num_groups: int, scores: Tensor
    ) -> Tensor:
        """α·(R_i − mean_g R), M counted on the raw verifier `scores`."""
        return gpg_advantages(rewards, group_index, num_groups, scores)[0]

    def policy_gradient_loss(
        self,
        logp: Tensor,
        logp_prox: Tensor,
        logp_behav: Tensor | None,
        advantages: Tensor,
        mask: Tensor,
        denominators: LossDenominators,
    ) -> tuple[Tensor, Metrics]:
        """Plain policy gradient, no ratio, no clip: `pg_loss`."""
        return pg_loss(
            logp, logp_prox, logp_behav, advantages, mask, **self._aggregation(denominators)
        )
