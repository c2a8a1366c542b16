"""The value-model family: PPO with GAE on a critic, and VAPO.

* VAPO (Yue et al., 2504.05118): decoupled GAE (value targets with λ_critic = 1, Monte-Carlo
  returns) and length-adaptive GAE for the policy (λ_policy = 1 − 1/(α·|o|)); Clip-Higher,
  token-mean, the positive-example LM loss; no KL. The critic is pre-trained on the frozen
  initial policy's responses before the first policy update (`streamrl.learner.loop`).
* PPO (Schulman et al. 1707.06347) with a fixed λ_policy, as the framework guide's VC-PPO
  (Yuan et al., 2503.01491: value pre-training, λ_critic = 1, λ_policy = 0.95) and
  Open-Reasoner-Zero (γ = λ = 1, no KL) presets use it (`vc_ppo`, `orz`).

Departs from the paper where it is silent: λ_policy is clamped at 0 for |o| < 1/α
(`length_adaptive_lambda`). Multi-turn responses (environment tokens between sampled ones) are
refused: GAE here runs over one contiguous run of response tokens.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field
from torch import Tensor

from streamrl.algorithms.advantages import decoupled_gae_advantages, length_adaptive_lambda
from streamrl.algorithms.base import ClippedAlgorithmBase, Responses
from streamrl.algorithms.losses import Metrics, value_loss

__all__ = ["PPOConfig", "VAPOConfig", "ValueAlgorithmBase"]


class ValueAlgorithmBase(ClippedAlgorithmBase):
    """What the value-model algorithms share: the critic, its targets and loss, its
    pre-training, and GAE whose policy λ each algorithm chooses (`policy_lambda`)."""

    gamma: float = Field(1.0, gt=0.0, le=1.0, description="Discount γ (VAPO: 1.0).")
    lam_critic: float = Field(
        1.0, ge=0.0, le=1.0, description="λ for value targets (1.0: Monte-Carlo returns)."
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

    def policy_lambda(self, lengths: Tensor) -> Tensor | float:
        """λ of the policy's GAE, per response (`lengths: [N]` sampled tokens) or one for all."""
        raise NotImplementedError

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
        """GAE on the critic's values with `policy_lambda` (policy), value targets with
        λ_critic."""
        if values is None:
            raise ValueError(f"{self.name}'s advantages need the critic's values; none were given")
        return decoupled_gae_advantages(
            outcomes,
            values,
            mask,
            gamma=self.gamma,
            lam_critic=self.lam_critic,
            lam_policy=self.policy_lambda(mask.float().sum(-1)),
        )

    def critic_loss(
        self, values: Tensor, old_values: Tensor, targets: Tensor, mask: Tensor, *, num_tokens: int
    ) -> tuple[Tensor, Metrics]:
        """The clipped value loss (ε_v = `value_clip`), token-mean over `num_tokens`."""
        return value_loss(
            values, old_values, targets, mask, clip=self.value_clip, num_tokens=num_tokens
        )


class VAPOConfig(ValueAlgorithmBase):
    """VAPO (Yue et al., 2504.05118): value model, decoupled and length-adaptive GAE."""

    name: Literal["vapo"] = "vapo"
    paper_defaults: ClassVar[dict[str, Any]] = {"clip_high": 0.28, "dual_clip": 10.0}
    length_alpha: float = Field(
        0.05, gt=0.0, description="α in λ_policy = 1 − 1/(α·|o|) (length-adaptive GAE)."
    )

    def policy_lambda(self, lengths: Tensor) -> Tensor:
        return length_adaptive_lambda(lengths, self.length_alpha)


class PPOConfig(ValueAlgorithmBase):
    """PPO with a critic and GAE at a fixed λ_policy; no positive-example loss, no value
    pre-training and λ_critic = λ_policy = 0.95 unless set (the `vc_ppo` and `orz` presets set
    them)."""

    name: Literal["ppo"] = "ppo"
    paper_defaults: ClassVar[dict[str, Any]] = {
        "lam_critic": 0.95,
        "nll_coef": 0.0,
        "value_pretrain_steps": 0,
    }
    lam_policy: float = Field(0.95, ge=0.0, le=1.0, description="λ of the policy's GAE.")

    def policy_lambda(self, lengths: Tensor) -> float:
        return self.lam_policy
