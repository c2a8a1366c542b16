"""The value-model family: PPO with GAE on a critic, and VAPO.

* VAPO (Yue et al., 2504.05118): decoupled GAE (value targets with λ_critic = 1, Monte-Carlo
  returns) and length-adaptive GAE for the policy (λ_policy = 1 − 1/(α·|o|)); Clip-Higher,
  token-mean, the positive-example LM loss; no KL. The critic is pre-trained on the frozen
  initial policy's responses before the first policy update (`streamrl.learner.loop`).
* PPO (Schulman et al. 1707.06347) with a fixed λ_policy, as the framework guide's VC-PPO
  (Yuan et al., 2503.01491: value pre-training, λ_critic = 1, λ_policy = 0.95) and
  Open-Reasoner-Zero (γ = λ = 1, no KL) presets use it (`vc_ppo`, `orz`).

The critic's head is `value_head` (`streamrl.algorithms.value_heads`: scalar, or the guide's
multi-head and distributional critics). Either algorithm takes the framework guide's weighted
value integration (eqs 17–18, `value_prior`): the policy's GAE runs on V_aug = w·V_pre +
(1 − w)·V_critic, V_pre the critic frozen when its pre-training ended, w(t) =
w0·exp(−κ·t/T)/(1 + η·rel_t) with rel_t an EMA of the critic's explained variance clipped to
[0, 1]; the critic still trains on targets from its own values.

Departs from the paper where it is silent: λ_policy is clamped at 0 for |o| < 1/α
(`length_adaptive_lambda`). Multi-turn responses (environment tokens between sampled ones) are
refused: GAE here runs over one contiguous run of response tokens.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

from pydantic import Field
from torch import Tensor

from streamrl.algorithms.advantages import decoupled_gae_advantages, length_adaptive_lambda
from streamrl.algorithms.base import ClippedAlgorithmBase, Responses
from streamrl.algorithms.losses import Metrics
from streamrl.algorithms.value_heads import ScalarHead, ValueHead
from streamrl.config.base import Section

__all__ = ["PPOConfig", "VAPOConfig", "ValueAlgorithmBase", "ValuePriorConfig"]


class ValuePriorConfig(Section):
    """The guide's weighted value integration (eqs 17–18): how much of the frozen pre-trained
    critic V_pre the policy's GAE mixes into the live critic's values, w(t) =
    w0·exp(−κ·t/T)/(1 + η·rel_t), t the policy step, T `learner.total_steps`."""

    w0: float = Field(0.5, ge=0.0, le=1.0, description="w0, the weight of V_pre at step 0.")
    kappa: float = Field(
        3.0, ge=0.0, description="κ: the weight decays as exp(−κ·t/T) over the run."
    )
    eta: float = Field(
        1.0,
        ge=0.0,
        description="η: a reliable live critic (explained variance near 1) divides the weight "
        "by up to 1 + η.",
    )
    ev_ema: float = Field(
        0.9,
        ge=0.0,
        lt=1.0,
        description="Decay of rel_t, the EMA of the critic's explained variance (clipped to "
        "[0, 1]) over its steps, pre-training included; 0 before any.",
    )

    def weight(self, step: int, total_steps: int, reliability: float) -> float:
        """w(t) at policy step `step` (0-based) of `total_steps`, given rel_t."""
        decay = math.exp(-self.kappa * step / max(total_steps, 1))
        return self.w0 * decay / (1.0 + self.eta * reliability)

    def reliability(self, previous: float, explained_var: float) -> float:
        """rel after a critic step whose explained variance was `explained_var`."""
        clipped = min(max(explained_var, 0.0), 1.0)
        return self.ev_ema * previous + (1.0 - self.ev_ema) * clipped


class ValueAlgorithmBase(ClippedAlgorithmBase):
    """What the value-model algorithms share: the critic, its targets and loss, its
    pre-training, and GAE whose policy λ each algorithm chooses (`policy_lambda`)."""

    gamma: float = Field(1.0, gt=0.0, le=1.0, description="Discount γ (VAPO: 1.0).")
    lam_critic: float = Field(
        1.0, ge=0.0, le=1.0, description="λ for value targets (1.0: Monte-Carlo returns)."
    )
    nll_coef: float = Field(0.1, ge=0.0, description="μ: weight of the positive-example LM loss.")
    value_clip: float = Field(0.5, gt=0.0, description="ε_v of the clipped value loss.")
    value_head: ValueHead = Field(
        default_factory=ScalarHead,
        description="The critic's head: kind scalar (the papers'), multi_head (eq 21: gated "
        "scalar heads) or distributional (eq 22: a distribution over returns on fixed atoms, "
        "trained by cross-entropy; value_clip does not apply).",
    )
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

    value_prior: ValuePriorConfig | None = Field(
        None,
        description="Weighted value integration (the guide's eqs 17–18): the policy's GAE uses "
        "w·V_pre + (1 − w)·V_critic, V_pre the critic frozen at the end of value pre-training "
        "(a second critic in memory and in checkpoints); null: the live critic alone.",
    )

    @property
    def per_token_advantages(self) -> str | None:
        return "GAE over its value model"

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
    def critic_prior(self) -> ValuePriorConfig | None:
        return self.value_prior

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
        policy_values: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """GAE with `policy_lambda` for the policy, on `policy_values` when given (V_aug of
        `value_prior`) else the critic's `values`; value targets with λ_critic on the critic's
        own values."""
        if values is None:
            raise ValueError(f"{self.name}'s advantages need the critic's values; none were given")
        gae = {
            "gamma": self.gamma,
            "lam_critic": self.lam_critic,
            "lam_policy": self.policy_lambda(mask.float().sum(-1)),
        }
        advantages, targets = decoupled_gae_advantages(outcomes, values, mask, **gae)
        if policy_values is not None:
            advantages, _ = decoupled_gae_advantages(outcomes, policy_values, mask, **gae)
        return advantages, targets

    def critic_loss(
        self,
        values: Tensor,
        old_values: Tensor,
        targets: Tensor,
        mask: Tensor,
        *,
        outputs: Tensor,
        num_tokens: int,
    ) -> tuple[Tensor, Metrics]:
        """The value head's loss (`value_head.loss`: the clipped value loss with ε_v =
        `value_clip` for scalar and multi-head, cross-entropy for distributional), token-mean
        over `num_tokens`."""
        return self.value_head.loss(
            outputs, values, old_values, targets, mask, clip=self.value_clip, num_tokens=num_tokens
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
