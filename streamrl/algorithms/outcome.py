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

GRPO, Dr. GRPO and DAPO take the framework guide's variants of their group advantage as
`advantage` (`streamrl.algorithms.variants`): a weighted baseline, rank-based, hierarchical,
temporal groups.

The formulas and their degenerate cases: `streamrl.algorithms.advantages`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, Tag
from torch import Tensor

from streamrl.algorithms.advantages import (
    dr_grpo_advantages,
    gpg_advantages,
    grpo_advantages,
    rloo_advantages,
)
from streamrl.algorithms.base import AlgorithmBase, ClippedAlgorithmBase, Responses
from streamrl.algorithms.losses import LossDenominators, Metrics
from streamrl.algorithms.policy_losses import pg_loss
from streamrl.algorithms.variants import (
    BaselineWeights,
    hierarchical_advantages,
    rank_advantages,
    temporal_advantages,
    weighted_baseline_advantages,
)
from streamrl.config.base import Section, tag_or, tagged_classes

__all__ = [
    "DAPOConfig",
    "DrGRPOConfig",
    "GPGConfig",
    "GRPOConfig",
    "GroupAdvantage",
    "HierarchicalAdvantage",
    "RLOOConfig",
    "RankAdvantage",
    "TemporalAdvantage",
]


class AdvantageVariant(Section):
    """What a group-advantage variant gives the algorithm that uses it."""

    def outcomes(self, responses: Responses, std_eps: float | None) -> Tensor:
        """Each response's outcome advantage `[N]`, over (std + `std_eps`) where the
        algorithm normalises by the group std (`std_eps` None: it does not)."""
        raise NotImplementedError

    @property
    def reward_history(self) -> tuple[int, int] | None:
        """`AlgorithmBase.reward_history`: None, the current batch alone."""
        return None


class GroupAdvantage(AdvantageVariant):
    """R − the group's baseline (over std + ε where the algorithm normalises): the paper's
    advantage with `baseline: uniform`, or the guide's weighted baseline (eqs 39, 52)."""

    kind: Literal["group"] = Field("group", description="group: R less the group baseline.")
    baseline: BaselineWeights = Field(
        "uniform",
        description="The group baseline Σq·R/Σq (eqs 39, 52): q uniform (the paper's group "
        "mean), inv_sqrt_len (1/√|o|: long responses weigh less) or confidence (exp of the "
        "mean behaviour log-prob: confident responses weigh more).",
    )

    def outcomes(self, responses: Responses, std_eps: float | None) -> Tensor:
        r, g, n = responses.rewards, responses.group_index, responses.num_groups
        if self.baseline == "uniform":  # the paper's own function: presets unchanged, bitwise
            return (
                dr_grpo_advantages(r, g, n)
                if std_eps is None
                else grpo_advantages(r, g, n, eps=std_eps)
            )
        return weighted_baseline_advantages(
            r, g, n, weights=self.baseline, lengths=responses.lengths,
            mean_logp_behav=responses.mean_logp_behav, std_eps=std_eps,
        )  # fmt: skip


class RankAdvantage(AdvantageVariant):
    """The guide's rank-based advantage (eq 40): (rank − (G + 1)/2) / (G/2), ties averaged."""

    kind: Literal["rank"] = Field("rank", description="rank: the reward's rank in its group.")

    def outcomes(self, responses: Responses, std_eps: float | None) -> Tensor:
        return rank_advantages(responses.rewards, responses.group_index, responses.num_groups)


class HierarchicalAdvantage(AdvantageVariant):
    """The guide's hierarchical advantage (eq 51): α·(R − mean_g) + (1 − α)·(R − mean_B),
    mean_B over the optimiser batch."""

    kind: Literal["hierarchical"] = Field(
        "hierarchical", description="hierarchical: group and batch baselines blended."
    )
    alpha: float = Field(0.8, ge=0.0, le=1.0, description="α, the weight of the group baseline.")

    def outcomes(self, responses: Responses, std_eps: float | None) -> Tensor:
        return hierarchical_advantages(
            responses.rewards, responses.group_index, responses.num_groups,
            responses.optimiser_batch, self.alpha,
        )  # fmt: skip


class TemporalAdvantage(AdvantageVariant):
    """The guide's temporal groups (Alg. 5): the baseline (and GRPO's std) over the group's
    rewards pooled with its prompt's last `history` rewards from earlier batches, sampled at
    most `max_age` versions before the learner's; only the current responses train."""

    kind: Literal["temporal"] = Field(
        "temporal", description="temporal: the prompt's earlier rewards join the baseline."
    )
    history: int = Field(
        16,
        ge=1,
        le=65_536,
        description="H: earlier rewards kept per prompt (the most recent), learner state "
        "saved in its checkpoints.",
    )
    max_age: int = Field(
        8,
        ge=0,
        le=1_000_000,
        description="Use an earlier reward only if its group was sampled at most this many "
        "weight versions before the learner's current one.",
    )

    def outcomes(self, responses: Responses, std_eps: float | None) -> Tensor:
        r = responses
        return temporal_advantages(
            r.rewards, r.group_index, r.num_groups, r.past_rewards, r.past_group, std_eps
        )

    @property
    def reward_history(self) -> tuple[int, int] | None:
        return self.history, self.max_age


OutcomeAdvantage = Annotated[
    Annotated[GroupAdvantage, Tag("group")]
    | Annotated[RankAdvantage, Tag("rank")]
    | Annotated[HierarchicalAdvantage, Tag("hierarchical")]
    | Annotated[TemporalAdvantage, Tag("temporal")],
    tag_or("kind", "group"),
]
ADVANTAGE_CLASSES = tagged_classes(OutcomeAdvantage, "kind")


class GroupAlgorithmBase(ClippedAlgorithmBase):
    """GRPO, Dr. GRPO and DAPO: a group advantage, the paper's or one of the guide's."""

    advantage: OutcomeAdvantage = Field(
        default_factory=GroupAdvantage,
        description="The group advantage: kind group (the paper's, or a weighted baseline), "
        "rank (eq 40), hierarchical (eq 51) or temporal (Alg. 5: earlier rewards of the "
        "prompt join the baseline).",
    )

    @property
    def reward_history(self) -> tuple[int, int] | None:
        return self.advantage.reward_history


class GRPOConfig(GroupAlgorithmBase):
    """GRPO (Shao et al., DeepSeekMath): group-normalised advantages, KL k3 to a frozen ref."""

    name: Literal["grpo"] = "grpo"
    paper_defaults: ClassVar[dict[str, Any]] = {
        "aggregation": "seq-mean-token-mean",
        "kl": {"estimator": "k3", "coef": 0.001, "reference": "frozen"},
    }
    std_eps: float = Field(1e-6, gt=0.0, description="ε in A = (R − mean) / (std + ε).")

    def response_outcomes(self, responses: Responses) -> Tensor:
        return self.advantage.outcomes(responses, self.std_eps)


class DrGRPOConfig(GroupAlgorithmBase):
    """Dr. GRPO (Liu et al., 2503.20783): no std division, constant length normaliser."""

    name: Literal["dr_grpo"] = "dr_grpo"
    paper_defaults: ClassVar[dict[str, Any]] = {"aggregation": "seq-mean-token-sum-norm"}

    def response_outcomes(self, responses: Responses) -> Tensor:
        return self.advantage.outcomes(responses, None)


class DAPOConfig(GroupAlgorithmBase):
    """DAPO (Yu et al., 2503.14476): Clip-Higher, dynamic sampling, token-mean, overlong shaping."""

    name: Literal["dapo"] = "dapo"
    paper_defaults: ClassVar[dict[str, Any]] = {
        "clip_high": 0.28,
        "dual_clip": 10.0,
        "dynamic_sampling": True,
        "overlong": {"shaping": True},
    }
    std_eps: float = Field(1e-6, gt=0.0, description="ε in A = (R − mean) / (std + ε).")

    def response_outcomes(self, responses: Responses) -> Tensor:
        """GRPO's group-normalised advantages (dynamic sampling happens in the collector)."""
        return self.advantage.outcomes(responses, self.std_eps)


class RLOOConfig(ClippedAlgorithmBase):
    """RLOO (Ahmadian et al., 2402.14740): leave-one-out baseline."""

    name: Literal["rloo"] = "rloo"

    def response_outcomes(self, responses: Responses) -> Tensor:
        return rloo_advantages(responses.rewards, responses.group_index, responses.num_groups)


class GPGConfig(AlgorithmBase):
    """GPG (Chu et al., 2504.02546): plain policy gradient with the α = B/(B − M) correction."""

    name: Literal["gpg"] = "gpg"

    def response_outcomes(self, responses: Responses) -> Tensor:
        """α·(R_i − mean_g R), M counted on the raw verifier scores."""
        r = responses
        return gpg_advantages(r.rewards, r.group_index, r.num_groups, r.scores)[0]

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
