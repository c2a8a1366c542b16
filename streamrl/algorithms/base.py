"""What every algorithm configuration shares: the correction, KL and overlong sub-configs,
the shared fields, and the interface through which a learner step asks an algorithm for what
differs per algorithm, so that the step itself has no per-algorithm branches
(`streamrl.learner.step`):

* models: `uses_value_model` (a critic), `reference_kl` / `needs_reference` (a reference
  policy, frozen or EMA);
* data: `multi_turn_refusal` (why it cannot train on multi-turn responses, if it cannot);
* advantages, in the three stages of the learner's micro-batched scoring pass:
  `response_outcomes` on the whole batch (`Responses` → `[N]`), `token_advantages` per
  micro-batch (`[n, T]`, and value targets for a critic), `normalise_advantages` over all
  micro-batches of all ranks; then `sequence_weights` (the guide's eq 30) scales each
  response's advantages, and so its policy loss;
* loss terms: `policy_gradient_loss` (the clipped surrogate, or GPG's plain policy gradient),
  `kl_loss` (β·KL as a loss term), `positive_nll_coef` (VAPO's μ), `entropy_coef`, and the
  critic's `critic_loss`; their denominators follow `aggregation` (`LossDenominators`).

The algorithms themselves: `streamrl.algorithms.outcome` (grpo, dr_grpo, dapo, rloo, gpg),
`streamrl.algorithms.reinforce_pp`, `streamrl.algorithms.vapo`; `streamrl.algorithms.config`
joins them as a discriminated union.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor

from streamrl.algorithms.advantages import broadcast_to_tokens
from streamrl.algorithms.correction_config import (
    CorrectionConfig,
    RolloutCorrection,
    correction_of_importance,
)
from streamrl.algorithms.distillation import OPDConfig
from streamrl.algorithms.kl import KLEstimator
from streamrl.algorithms.losses import Aggregation, LossDenominators, Metrics
from streamrl.algorithms.policy_losses import (
    PolicyLoss,
    PPOClipLoss,
    check_loss_fields,
    policy_loss,
)
from streamrl.algorithms.shaping import RewardScale
from streamrl.algorithms.variants import sequence_length_weights
from streamrl.config.base import Section
from streamrl.config.merge import deep_merge

__all__ = [
    "AlgorithmBase",
    "ClippedAlgorithmBase",
    "KLConfig",
    "OverlongConfig",
    "Responses",
]


@dataclass(frozen=True)
class Responses:
    """What the first stage of the advantages reads of a training batch, per response `[N]`:

    rewards          float32, the shaped outcome reward
    scores           float32, the raw verifier score (correctness)
    group_index      int64, dense group ids 0..num_groups − 1
    lengths          float32, the tokens the policy sampled (|o_i|)
    mean_logp_behav  float32, the mean behaviour log-prob over them (0 without any)
    optimiser_batch  int64, the mini-batch (optimiser update) the response trains in
    median_length    float32, the median |o| of the loss-bearing responses of that mini-batch

    and the prompts' earlier rewards (temporal groups; empty unless the algorithm keeps them,
    `reward_history`), `[M]` each:

    past_rewards     float32, a reward of an earlier batch for the prompt of ...
    past_group       int64, ... this batch's group
    """

    rewards: Tensor
    scores: Tensor
    group_index: Tensor
    num_groups: int
    lengths: Tensor
    mean_logp_behav: Tensor
    optimiser_batch: Tensor
    median_length: Tensor
    past_rewards: Tensor = field(default_factory=lambda: torch.zeros(0))
    past_group: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    def to(self, device: torch.device) -> Responses:
        moved = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in vars(self).items()}
        return Responses(**moved)


class KLConfig(Section):
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


class OverlongConfig(Section):
    """DAPO's treatment of responses that approach or hit the length limit."""

    shaping: bool = Field(
        False, description="Add the soft overlong punishment R_len (DAPO eq. 13) to the reward."
    )
    cache_len: int | None = Field(
        None,
        gt=0,
        le=2**20,
        description="L_cache, the soft buffer in tokens; default: generator.max_tokens / 5.",
    )
    filter: bool = Field(
        False, description="Mask truncated responses out of the loss (still counted in metrics)."
    )


class LengthPenaltyConfig(Section):
    """The framework guide's adaptive length penalty (eqs 31–33), an alternative to overlong
    shaping: R = R_base − λ(R_base)·pen(|o|, R_base), with R_base the rule reward
    (`reward_scale`) and |o| the tokens the policy sampled;
    pen = a·ln(1 + |o|/L_target) if R_base > r_th, else b·(|o|/L_target)²;
    λ(r) = λ_base·exp(−γ·max(0, r − r_th)).

    The guide gives no values; the defaults keep correctness dominant on both reward scales: a
    correct answer (R_base = 1 on either) loses at most λ_base·e^(−γ)·a·ln 3 ≈ 0.04 at
    generator.max_tokens = 2·L_target, a wrong one (−1 or 0) at most λ_base·b·4 = 0.4.
    """

    target: int | None = Field(
        None,
        gt=0,
        le=2**20,
        description="L_target, the length in tokens the penalty is measured against (at most "
        "generator.max_tokens for single-turn responses); default: generator.max_tokens / 2, "
        "so a wrong answer that fills the budget pays 4·b·λ_base.",
    )
    a: float = Field(
        1.0,
        ge=0.0,
        description="Scale of the logarithmic penalty a·ln(1 + |o|/L_target) on answers above "
        "r_th (eq 32): mild pressure toward shorter correct answers. 1: λ_base sets the size.",
    )
    b: float = Field(
        1.0,
        ge=0.0,
        description="Scale of the quadratic penalty b·(|o|/L_target)² on answers at or below "
        "r_th (eq 32): long wrong answers pay most. 1: λ_base sets the size.",
    )
    r_th: float = Field(
        0.0,
        ge=-1.0,
        le=1.0,
        description="r_th, the reward above which an answer counts as good (eqs 32–33). 0 "
        "splits correct from wrong on both scales: +1 vs −1 (plus_minus_one), 1 vs 0 (zero_one; "
        "R_base = r_th takes the quadratic branch).",
    )
    lambda_base: float = Field(
        0.1,
        gt=0.0,
        description="λ_base, the penalty's weight (eq 33). 0.1 keeps the whole penalty well under "
        "the reward gap between a correct and a wrong answer (1 on zero_one).",
    )
    gamma: float = Field(
        1.0,
        ge=0.0,
        description="γ, how fast λ decays as the reward rises above r_th (eq 33): by default a "
        "correct answer (R_base − r_th = 1) pays e^(−γ) ≈ 0.37 of λ_base.",
    )


class AlgorithmBase(Section):
    """Fields every algorithm shares, and what a learner step asks of an algorithm (see the
    module docstring): the outcome family's behaviour by default, overridden where a family
    departs from it.

    Subclasses state where their paper departs from these field defaults in `paper_defaults`;
    user input is deep-merged over them, so `overlong: {filter: true}` on DAPO keeps DAPO's
    overlong shaping on, and `kl: null` turns GRPO's KL off.
    """

    paper_defaults: ClassVar[dict[str, Any]] = {}

    @model_validator(mode="before")
    @classmethod
    def _apply_paper_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return deep_merge(cls.paper_defaults, _importance_as_correction(data))
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
    length_penalty: LengthPenaltyConfig | None = Field(
        None,
        description="The framework guide's adaptive length penalty (eqs 31–33) on the reward, an "
        "alternative to overlong.shaping (set one); null disables.",
    )
    correction: CorrectionConfig = Field(
        default_factory=RolloutCorrection,
        description="Off-policy correction for the gap between the generator's and the "
        "learner's log-probs (staleness, engine mismatch): method rollout (truncated IS, "
        "rejection band, veto), icepop or none. The older importance: {mode, cap} still reads.",
    )
    aggregation: Aggregation = Field(
        "token-mean",
        description="Loss aggregation: token-mean, seq-mean-token-mean or "
        "seq-mean-token-sum-norm, over the whole optimiser mini-batch.",
    )
    entropy_coef: float = Field(
        0.0, ge=0.0, description="c_H: loss −= c_H · token-mean entropy (T1). 0 disables."
    )
    opd: OPDConfig | None = Field(
        None,
        description="On-policy distillation: a teacher's log-probs on the student's samples as "
        "a per-token advantage, λ_rl·A + λ_opd·Σ γ^(k−t)·(logp_T − logp_behav)_k "
        "(docs/algorithms.md); needs generator.teacher. null (default): off. "
        "algorithm.opd.lambda_rl=0 distils only.",
    )
    length_reweight: float = Field(
        0.0,
        ge=0.0,
        le=0.5,
        description="α_w of sequence-level reweighting (the framework guide's eq 30): each "
        "response's policy loss times (|o| / L_median)^(−α_w), L_median the median length of "
        "the loss-bearing responses of its optimiser batch; 0 disables.",
    )

    # -- models -----------------------------------------------------------------------------

    @property
    def uses_value_model(self) -> bool:
        """Whether this algorithm trains a critic."""
        return False

    @property
    def critic_prior(self) -> Any:
        """Weighted value integration (a `ValuePriorConfig` of `streamrl.algorithms.vapo`): the
        frozen pre-trained critic the policy's GAE blends in, or None (default)."""
        return None

    @property
    def needs_groups(self) -> bool:
        """Whether advantages compare responses within a group (so G ≥ 2 is required)."""
        return True

    @property
    def reference_kl(self) -> KLConfig | None:
        """The KL regularisation toward a reference policy, or None: no reference model."""
        return None

    @property
    def multi_turn_refusal(self) -> str | None:
        """Why this algorithm cannot train on multi-turn groups (environment tokens between
        sampled ones), or None: it can. The outcome family can: advantages broadcast over the
        sampled tokens, every loss term and denominator counts only them."""
        return None

    @property
    def reward_history(self) -> tuple[int, int] | None:
        """Temporal groups: `(H, max_age)`, the learner keeps each prompt's last H rewards of
        at most max_age versions ago for the advantages (`Responses.past_rewards`) and
        checkpoints them; None (default): advantages see the current batch only."""
        return None

    @property
    def needs_reference(self) -> bool:
        """Whether the algorithm compares the policy with a reference policy (a KL term)."""
        return self.reference_kl is not None

    # -- advantages ---------------------------------------------------------------------------

    def response_outcomes(self, responses: Responses) -> Tensor:
        """Stage 1, on the whole batch: what each response's outcome brings to its token
        advantages, `[N]` float32 — its outcome advantage (the outcome family), or its reward
        (less the group mean for REINFORCE++-baseline)."""
        raise NotImplementedError

    def token_advantages(
        self,
        outcomes: Tensor,
        mask: Tensor,
        *,
        ref_kl: Tensor | None = None,
        values: Tensor | None = None,
        policy_values: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Stage 2, per micro-batch: token advantages `[n, T]` float32 (zero off `mask`) and
        the critic's value targets `[n, T]` (None without a critic).

        Args:
            outcomes: `[n]`, `response_outcomes` of these responses.
            mask: `[n, T]` the sampled response tokens (`MicroBatch.sampled_mask`: environment
                tokens of a multi-turn response excluded).
            ref_kl: `[n, T]` KL of the behaviour policy to the reference, when there is one.
            values: `[n, T]` the critic's values when the batch was scored, when there is one.
            policy_values: `[n, T]` the values the policy's advantages use instead, when they
                differ from the critic's (weighted value integration: V_aug).

        The outcome family: the response's outcome advantage on each of its sampled tokens."""
        return broadcast_to_tokens(outcomes, mask), None

    def normalise_advantages(
        self,
        advantages: Sequence[Tensor],
        masks: Sequence[Tensor],
        process_group: torch.distributed.ProcessGroup | None = None,
    ) -> list[Tensor]:
        """Stage 3, over every micro-batch (`[n_k, T_k]` each, with its loss mask) on every
        rank of `process_group`: the advantages the losses use. Unchanged by default."""
        return list(advantages)

    def sequence_weights(self, lengths: Tensor, median_length: Tensor) -> Tensor | None:
        """Each response's factor on its advantages (eq 30, `length_reweight`): `[n]`, or None
        when off. Scaling a response's advantages scales its clipped (or plain) policy loss
        alike: both are positively homogeneous in A."""
        if self.length_reweight == 0.0:
            return None
        return sequence_length_weights(lengths, median_length, self.length_reweight)

    # -- loss terms ---------------------------------------------------------------------------

    def policy_gradient_loss(
        self,
        logp: Tensor,
        logp_prox: Tensor,
        logp_behav: Tensor | None,
        advantages: Tensor,
        mask: Tensor,
        denominators: LossDenominators,
    ) -> tuple[Tensor, Metrics]:
        """The policy-gradient term of one micro-batch, its exact share of the mini-batch's
        (`ppo_policy_loss` or `pg_loss` with this algorithm's off-policy correction and
        aggregation; tensors `[n, T]`)."""
        raise NotImplementedError

    def _aggregation(self, denominators: LossDenominators) -> dict[str, Any]:
        """The keywords the policy losses share: off-policy correction and aggregation over
        the mini-batch's global denominators."""
        return {
            "correction": self.correction,
            "weight_mean": denominators.weight_mean,
            "aggregation": self.aggregation,
            "num_tokens": denominators.tokens,
            "num_seqs": denominators.sequences(self.aggregation),
            "max_len": denominators.max_len,
        }

    @property
    def kl_loss(self) -> KLConfig | None:
        """The KL to the reference as a loss term (β · token-mean KL), or None."""
        kl = self.reference_kl
        return kl if kl is not None and kl.placement == "loss" else None

    @property
    def positive_nll_coef(self) -> float:
        """μ, the weight of the positive-example LM loss (VAPO); 0: no such term."""
        return 0.0

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
        """The critic's loss on one micro-batch (algorithms with a value model): `values`
        `[n, T]` V and `outputs` `[n, T, K]` the value head's outputs V is read from."""
        raise TypeError(f"algorithm {self.name!r} has no value model")


class ClippedAlgorithmBase(AlgorithmBase):
    """Algorithms optimising a ratio surrogate: PPO's clipped token ratio unless
    `policy_loss` names another (`streamrl.algorithms.policy_losses`)."""

    policy_loss: PolicyLoss = Field(
        default_factory=PPOClipLoss,
        description="The policy loss, by kind: ppo_clip (the clipped token ratio; default), "
        "gspo, gspo_token, cispo or sapo, each with its own parameters (docs/algorithms.md, "
        "'Policy losses beyond the clipped ratio'). algorithm.clip_low / clip_high / "
        "dual_clip still read as ppo_clip's.",
    )
    kl: KLConfig | None = Field(None, description="KL to a reference policy; null disables.")

    kl_in_reward: ClassVar[bool] = False
    """Whether `kl.placement='reward'` is defined (REINFORCE++ only)."""
    older_fields: ClassVar[tuple[str, ...]] = ("clip_low", "clip_high", "dual_clip")

    @model_validator(mode="before")
    @classmethod
    def _apply_paper_defaults(cls, data: Any) -> Any:
        """As `AlgorithmBase`'s, with the older top-level clip fields (the user's and the
        paper's) read as `policy_loss` ppo_clip's; a paper's clip defaults do not reach
        another loss."""
        if not isinstance(data, dict):
            return data
        data = _clip_fields_as_policy_loss(_importance_as_correction(data), "algorithm")
        loss = data.get("policy_loss")
        defaults = dict(cls.paper_defaults)
        clip_defaults = {k: defaults.pop(k) for k in _CLIP_FIELDS if k in defaults}
        if _loss_kind(loss) == "ppo_clip" and not isinstance(loss, PPOClipLoss):
            defaults["policy_loss"] = {"kind": "ppo_clip", **clip_defaults}
        merged = deep_merge(defaults, data)
        check_loss_fields(merged.get("policy_loss"))
        return merged

    @model_validator(mode="after")
    def _kl_in_reward_only_for_reinforce_pp(self) -> ClippedAlgorithmBase:
        if self.kl is not None and self.kl.placement == "reward" and not self.kl_in_reward:
            raise ValueError(
                "kl.placement='reward' is only defined for reinforce_pp; "
                "use kl.placement='loss' for this algorithm"
            )
        return self

    @model_validator(mode="after")
    def _loss_takes_these_advantages(self) -> ClippedAlgorithmBase:
        loss = self.policy_loss
        if self.opd is not None and not loss.per_token_advantages:
            raise ValueError(
                f"policy_loss {loss.kind!r} is defined for one advantage per response (its "
                "ratio is the response's), but on-policy distillation (algorithm.opd) gives "
                "each token its own (the teacher's log-prob gap); use policy_loss.kind="
                "gspo_token, which takes per-token advantages, or set algorithm.opd=null"
            )
        if self.per_token_advantages and not loss.per_token_advantages:
            raise ValueError(
                f"policy_loss {loss.kind!r} is defined for one advantage per response (its "
                f"ratio is the response's), but {self.name} gives each token its own "
                f"({self.per_token_advantages}); use policy_loss.kind=gspo_token, which takes "
                "per-token advantages, or an outcome algorithm (grpo, dapo, ...)"
            )
        return self

    @property
    def per_token_advantages(self) -> str | None:
        """Why this algorithm's advantages differ between the tokens of a response, or None
        when each response has one."""
        return None

    @property
    def reference_kl(self) -> KLConfig | None:
        return self.kl

    def policy_gradient_loss(
        self,
        logp: Tensor,
        logp_prox: Tensor,
        logp_behav: Tensor | None,
        advantages: Tensor,
        mask: Tensor,
        denominators: LossDenominators,
    ) -> tuple[Tensor, Metrics]:
        """`policy_loss`'s term (`streamrl.algorithms.policy_losses.policy_loss`)."""
        return policy_loss(
            self.policy_loss,
            logp,
            logp_prox,
            logp_behav,
            advantages,
            mask,
            **self._aggregation(denominators),
        )


_CLIP_FIELDS = ("clip_low", "clip_high", "dual_clip")


def _loss_kind(loss: Any) -> str:
    """The kind of a `policy_loss` as given: a mapping, a loss, or nothing (ppo_clip)."""
    if loss is None:
        return "ppo_clip"
    return loss.get("kind", "ppo_clip") if isinstance(loss, dict) else loss.kind


def _clip_fields_as_policy_loss(data: dict[str, Any], where: str) -> dict[str, Any]:
    """`data` with its top-level clip fields (the older spelling) moved into its
    `policy_loss`, which they must then be ppo_clip's."""
    given = {k: data[k] for k in _CLIP_FIELDS if k in data}
    if not given:
        return data
    loss = data.get("policy_loss") or {}
    if isinstance(loss, PPOClipLoss):
        loss = loss.model_dump()
    kind = _loss_kind(loss)
    if kind != "ppo_clip":
        names = ", ".join(f"{where}.{k}" for k in given)
        raise ValueError(
            f"{names}: the clipped token ratio's parameters (policy_loss ppo_clip), but "
            f"{where}.policy_loss.kind is {kind}; set that loss's own parameters under "
            f"{where}.policy_loss instead"
        )
    rest = {k: v for k, v in data.items() if k not in _CLIP_FIELDS}
    return {**rest, "policy_loss": {"kind": "ppo_clip", **loss, **given}}


def _importance_as_correction(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with the older `importance: {mode, cap}` spelled as the `correction` block."""
    if "importance" not in data:
        return data
    if "correction" in data:
        raise ValueError(
            "set algorithm.correction only: algorithm.importance is its older spelling "
            "(importance.mode tis = correction.is_level token, mask = rs_level token)"
        )
    data = dict(data)
    data["correction"] = correction_of_importance(data.pop("importance"))
    return data
