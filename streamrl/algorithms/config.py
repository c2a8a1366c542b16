"""Algorithm configuration: one pydantic model per algorithm, joined as a discriminated union.

Each class's defaults are its paper's; `name` selects the variant.
Fields an algorithm does not use do not exist on its class, so setting one is an error that
names the field (GPG has no clip range, GRPO no value model).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from streamrl._dicts import deep_merge
from streamrl.algorithms.kl import KLEstimator
from streamrl.algorithms.losses import Aggregation, ImportanceMode
from streamrl.algorithms.shaping import RewardScale

__all__ = [
    "ALGORITHM_CLASSES",
    "ALGORITHM_NAMES",
    "AlgorithmConfig",
    "DAPOConfig",
    "DrGRPOConfig",
    "GPGConfig",
    "GRPOConfig",
    "ImportanceConfig",
    "KLConfig",
    "OverlongConfig",
    "RLOOConfig",
    "ReinforcePPConfig",
    "VAPOConfig",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ImportanceConfig(_Strict):
    """Correction for the mismatch between the behaviour policy (generator) and the learner."""

    mode: ImportanceMode = Field(
        "tis",
        description="tis: weight tokens by min(π_prox/π_behav, cap); mask: drop tokens whose "
        "ratio exceeds cap; none: ignore the mismatch (only sound when max_staleness = 0 and "
        "generator and learner compute identical log-probs).",
    )
    cap: float = Field(2.0, ge=1.0, description="Truncation / rejection threshold C (≥ 1).")


class KLConfig(_Strict):
    """KL regularisation against a reference policy."""

    estimator: KLEstimator = Field("k3", description="Per-token estimator: k1, k2 or k3.")
    coef: float = Field(0.001, gt=0.0, description="β, the KL coefficient.")
    placement: Literal["loss", "reward"] = Field(
        "loss",
        description="loss: add β·KL (token-mean) to the loss; reward: subtract β·KL from the "
        "token reward (REINFORCE++ only).",
    )
    reference: Literal["frozen", "ema"] = Field(
        "frozen", description="frozen: the initial policy; ema: an EMA of the policy (T1)."
    )
    ema_tau: float = Field(
        0.99, ge=0.0, lt=1.0, description="τ in θ_ref ← τ·θ_ref + (1 − τ)·θ (reference=ema)."
    )


class OverlongConfig(_Strict):
    """DAPO's treatment of responses that approach or hit the length limit."""

    shaping: bool = Field(
        False, description="Add the soft overlong punishment R_len (DAPO eq. 13) to the reward."
    )
    cache_len: int | None = Field(
        None,
        gt=0,
        description="L_cache, the soft buffer in tokens; default: generator.max_tokens / 5.",
    )
    filter: bool = Field(
        False, description="Mask truncated responses out of the loss (still counted in metrics)."
    )


class _AlgorithmBase(_Strict):
    """Fields every algorithm shares.

    Subclasses state where their paper departs from these field defaults in `paper_defaults`;
    user input is deep-merged over them, so `overlong: {filter: true}` on DAPO keeps DAPO's
    overlong shaping on, and `kl: null` turns GRPO's KL off.
    """

    paper_defaults: ClassVar[dict[str, Any]] = {}

    @model_validator(mode="before")
    @classmethod
    def _apply_paper_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return deep_merge(cls.paper_defaults, data)
        return data

    reward_scale: RewardScale = Field(
        "plus_minus_one",
        description="Rule reward: plus_minus_one (+1 correct / −1 wrong, DAPO) or zero_one.",
    )
    dynamic_sampling: bool = Field(
        False,
        description="Skip groups whose rewards are all equal (DAPO dynamic sampling); the "
        "learner reads on until its batch holds enough groups with signal.",
    )
    overlong: OverlongConfig = Field(
        default_factory=OverlongConfig, description="Overlong reward shaping and filtering."
    )
    importance: ImportanceConfig = Field(
        default_factory=ImportanceConfig, description="Behaviour-policy importance correction."
    )
    aggregation: Aggregation = Field(
        "token-mean",
        description="Loss aggregation: token-mean, seq-mean-token-mean or "
        "seq-mean-token-sum-norm, over the whole optimiser mini-batch.",
    )
    entropy_coef: float = Field(
        0.0, ge=0.0, description="c_H: loss −= c_H · token-mean entropy (T1). 0 disables."
    )

    @property
    def uses_value_model(self) -> bool:
        """Whether this algorithm trains a critic."""
        return False

    @property
    def needs_groups(self) -> bool:
        """Whether advantages compare responses within a group (so G ≥ 2 is required)."""
        return True


class _ClippedBase(_AlgorithmBase):
    """Algorithms optimising the clipped surrogate objective."""

    clip_low: float = Field(0.2, gt=0.0, lt=1.0, description="ε_low: ratio floor is 1 − ε_low.")
    clip_high: float = Field(0.2, gt=0.0, description="ε_high: ratio ceiling is 1 + ε_high.")
    dual_clip: float | None = Field(
        None,
        gt=1.0,
        description="c of the dual clip: the loss of a negative-advantage token is at most "
        "−c·A. null disables.",
    )
    kl: KLConfig | None = Field(None, description="KL to a reference policy; null disables.")

    @model_validator(mode="after")
    def _kl_in_reward_only_for_reinforce_pp(self) -> _ClippedBase:
        if (
            self.kl is not None
            and self.kl.placement == "reward"
            and not isinstance(self, ReinforcePPConfig)
        ):
            raise ValueError(
                "kl.placement='reward' is only defined for reinforce_pp; "
                "use kl.placement='loss' for this algorithm"
            )
        return self


class GRPOConfig(_ClippedBase):
    """GRPO (Shao et al., DeepSeekMath): group-normalised advantages, KL k3 to a frozen ref."""

    name: Literal["grpo"] = "grpo"
    paper_defaults: ClassVar[dict[str, Any]] = {
        "aggregation": "seq-mean-token-mean",
        "kl": {"estimator": "k3", "coef": 0.001, "reference": "frozen"},
    }
    std_eps: float = Field(1e-6, gt=0.0, description="ε in A = (R − mean) / (std + ε).")


class DrGRPOConfig(_ClippedBase):
    """Dr. GRPO (Liu et al., 2503.20783): no std division, constant length normaliser."""

    name: Literal["dr_grpo"] = "dr_grpo"
    paper_defaults: ClassVar[dict[str, Any]] = {"aggregation": "seq-mean-token-sum-norm"}


class DAPOConfig(_ClippedBase):
    """DAPO (Yu et al., 2503.14476): Clip-Higher, dynamic sampling, token-mean, overlong shaping."""

    name: Literal["dapo"] = "dapo"
    paper_defaults: ClassVar[dict[str, Any]] = {
        "clip_high": 0.28,
        "dual_clip": 10.0,
        "dynamic_sampling": True,
        "overlong": {"shaping": True},
    }
    std_eps: float = Field(1e-6, gt=0.0, description="ε in A = (R − mean) / (std + ε).")


class VAPOConfig(_ClippedBase):
    """VAPO (Yue et al., 2504.05118): value model, decoupled and length-adaptive GAE."""

    name: Literal["vapo"] = "vapo"
    paper_defaults: ClassVar[dict[str, Any]] = {"clip_high": 0.28, "dual_clip": 10.0}
    gamma: float = Field(1.0, gt=0.0, le=1.0, description="Discount γ (VAPO: 1.0).")
    lam_critic: float = Field(
        1.0, ge=0.0, le=1.0, description="λ for value targets (1.0: Monte-Carlo returns)."
    )
    length_alpha: float = Field(
        0.05, gt=0.0, description="α in λ_policy = 1 − 1/(α·|o|) (length-adaptive GAE)."
    )
    nll_coef: float = Field(0.1, ge=0.0, description="μ: weight of the positive-example LM loss.")
    value_clip: float = Field(0.5, gt=0.0, description="ε_v of the clipped value loss.")
    value_pretrain_steps: int = Field(
        50, ge=0, description="Critic-only steps on the frozen initial policy before training."
    )
    value_pretrain_target_ev: float = Field(
        0.9,
        le=1.0,
        description="Stop value pre-training early once explained variance reaches this.",
    )

    @property
    def uses_value_model(self) -> bool:
        return True

    @property
    def needs_groups(self) -> bool:
        return False


class RLOOConfig(_ClippedBase):
    """RLOO (Ahmadian et al., 2402.14740): leave-one-out baseline."""

    name: Literal["rloo"] = "rloo"


class ReinforcePPConfig(_ClippedBase):
    """REINFORCE++ (Hu, 2501.03262): KL in the token reward, global advantage normalisation."""

    name: Literal["reinforce_pp"] = "reinforce_pp"
    baseline: bool = Field(
        False, description="REINFORCE++-baseline: subtract the group mean reward first."
    )
    paper_defaults: ClassVar[dict[str, Any]] = {
        "kl": {"estimator": "k1", "coef": 0.01, "placement": "reward"},
    }

    @property
    def needs_groups(self) -> bool:
        return self.baseline


class GPGConfig(_AlgorithmBase):
    """GPG (Chu et al., 2504.02546): plain policy gradient with the α = B/(B − M) correction."""

    name: Literal["gpg"] = "gpg"


AlgorithmConfig = Annotated[
    GRPOConfig
    | DrGRPOConfig
    | DAPOConfig
    | VAPOConfig
    | RLOOConfig
    | ReinforcePPConfig
    | GPGConfig,
    Field(discriminator="name"),
]

ALGORITHM_CLASSES: dict[str, type[_AlgorithmBase]] = {
    cls.model_fields["name"].default: cls
    for cls in (
        GRPOConfig,
        DrGRPOConfig,
        DAPOConfig,
        VAPOConfig,
        RLOOConfig,
        ReinforcePPConfig,
        GPGConfig,
    )
}
ALGORITHM_NAMES: tuple[str, ...] = tuple(ALGORITHM_CLASSES)
