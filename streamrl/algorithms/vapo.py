"""VAPO (Yue et al., 2504.05118): a value model; decoupled GAE (value targets with
λ_critic = 1, Monte-Carlo returns) and length-adaptive GAE for the policy
(λ_policy = 1 − 1/(α·|o|)); Clip-Higher, token-mean, the positive-example LM loss; no KL.
The critic is pre-trained on the frozen initial policy's responses before the first policy
update (`streamrl.learner.loop`).

Departs from the paper where it is silent: λ_policy is clamped at 0 for |o| < 1/α
(`length_adaptive_lambda`). Multi-turn responses (environment tokens between sampled ones) are
refused: GAE here runs over one contiguous run of response tokens.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field
from torch import Tensor

from streamrl.algorithms.advantages import vapo_advantages
from streamrl.algorithms.base import ClippedAlgorithmBase, Responses
from streamrl.algorithms.losses import Metrics, value_loss

__all__ = ["VAPOConfig"]


class VAPOConfig(ClippedAlgorithmBase):
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
        50,
        ge=0,
        le=10**6,
        description="Critic-only steps on the frozen initial policy before training.",
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

    @property
    def multi_turn_refusal(self) -> str | None:
        return (
            "its GAE (value targets and length-adaptive λ) runs over one contiguous run of "
            "response tokens, and is not defined across environment tokens yet"
        )

    @property
    def positive_nll_coef(self) -> float:
        return self.nll_coef

    def response_outcomes(self, responses: Responses) -> Tensor:
        """The reward itself: GAE places it on the last token."""
        return responses.rewards.float()

    def token_advantages(
        self,
        outcomes: Tensor,
        mask: Tensor,
        *,
        ref_kl: Tensor | None = None,
        values: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Length-adaptive GAE on the critic's values (policy), value targets with λ_critic."""
        if values is None:
            raise ValueError("VAPO's advantages need the critic's values; none were given")
        return vapo_advantages(
            outcomes,
            values,
            mask,
            gamma=self.gamma,
            lam_critic=self.lam_critic,
            alpha=self.length_alpha,
        )

    def critic_loss(
        self, values: Tensor, old_values: Tensor, targets: Tensor, mask: Tensor, *, num_tokens: int
    ) -> tuple[Tensor, Metrics]:
        """The clipped value loss (ε_v = `value_clip`), token-mean over `num_tokens`."""
        return value_loss(
            values, old_values, targets, mask, clip=self.value_clip, num_tokens=num_tokens
        )
