"""The `algorithm.correction` block: which off-policy correction a learner applies
(`streamrl.algorithms.correction` holds the math; docs/algorithms.md "Off-policy correction: the
full menu").

Three methods, a discriminated union on `method` (`rollout` when left out):

* `rollout`: truncated importance weights at token or sequence level (optionally normalised
  over the batch), a rejection band at token, sequence or geometric level, and the veto;
* `icepop`: IcePop's two-sided token band, the full ratio inside it;
* `none`: no correction.

The older `algorithm.importance: {mode, cap}` still reads, as the rollout method it always was
(`correction_of_importance`): existing configs and runs resume unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

import torch
from pydantic import Field, Tag, model_validator
from torch import Tensor

from streamrl.algorithms.correction import Correction, correct
from streamrl.algorithms.masked import zero_outside
from streamrl.config.base import Section, tag_or, tagged_classes

__all__ = [
    "CORRECTION_CLASSES",
    "CorrectionConfig",
    "IcePopCorrection",
    "NoCorrection",
    "RolloutCorrection",
    "correction_of_importance",
]


class _CorrectionMethod(Section):
    """What every method offers the losses: `apply` (its weights and narrowed mask for one
    micro-batch) from the keywords of `correct` it sets (`options`)."""

    normalises: ClassVar[bool] = False
    """Whether the weights are divided by their batch mean (the learner's scoring pass
    computes it: `RolloutCorrection.weight_sums`)."""

    def options(self) -> dict[str, Any]:
        """The keywords of `correct` this method sets."""
        raise NotImplementedError

    def apply(
        self,
        logp_prox: Tensor,
        logp_behav: Tensor | None,
        mask: Tensor,
        weight_mean: float | Tensor | None = None,
    ) -> Correction:
        """The correction of one micro-batch (`correct`; tensors `[N, T]`); `weight_mean` is
        used only by a method that normalises."""
        normaliser = weight_mean if self.normalises else None
        return correct(logp_prox, logp_behav, mask, weight_mean=normaliser, **self.options())


class RolloutCorrection(_CorrectionMethod):
    """Truncated importance sampling, a rejection band and the veto, in any combination
    (verl's rollout correction, AReaL's decoupled PPO). The default, token-level truncation
    at C = 2, is every preset's correction."""

    method: Literal["rollout"] = Field(
        "rollout", description="rollout: truncated IS, rejection band and veto (the default)."
    )
    is_level: Literal["token", "sequence", "none"] = Field(
        "token",
        description="Level of the truncated IS weight w = min(ρ, is_cap): token (TIS), "
        "sequence (ρ of the whole response), none (w = 1).",
    )
    is_cap: float = Field(2.0, ge=1.0, description="C_is, the truncation cap of the weight.")
    is_normalize: bool = Field(
        False,
        description="Divide the truncated weights by their mean over the kept loss tokens (not "
        "rejected or vetoed) of the whole optimiser batch (all ranks), so they average 1 "
        "there. Costs one extra forward pass per step when the batch makes one optimiser "
        "update.",
    )
    rs_level: Literal["token", "sequence", "geometric", "none"] = Field(
        "none",
        description="Rejection sampling: drop tokens (token) or whole responses (sequence, "
        "geometric) whose ratio lies outside [rs_low, rs_high]; none: reject nothing.",
    )
    rs_high: float = Field(2.0, gt=0.0, description="c_high, the top of the rejection band.")
    rs_low: float | None = Field(
        None, ge=0.0, description="c_low, the bottom of the rejection band; default 1/rs_high."
    )
    veto: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description="τ_veto: drop every token of a response with a token whose ratio is below "
        "this (e.g. 1e-4: a token the learner finds catastrophically unlikely); null: off.",
    )

    @model_validator(mode="after")
    def _band_is_a_band(self) -> RolloutCorrection:
        if self.rs_level != "none" and self.rejection_band[0] >= self.rs_high:
            raise ValueError(
                f"rs_low ({self.rejection_band[0]}) must be below rs_high ({self.rs_high}): "
                "the band [rs_low, rs_high] keeps the ratios inside it"
            )
        return self

    @model_validator(mode="after")
    def _normalise_a_weight(self) -> RolloutCorrection:
        if self.is_normalize and self.is_level == "none":
            raise ValueError(
                "is_normalize needs an importance weight to normalise: set is_level to token "
                "or sequence, or is_normalize=false"
            )
        return self

    @property
    def rejection_band(self) -> tuple[float, float]:
        """[c_low, c_high]."""
        return (1.0 / self.rs_high if self.rs_low is None else self.rs_low, self.rs_high)

    @property
    def normalises(self) -> bool:  # type: ignore[override]
        return self.is_normalize

    def options(self) -> dict[str, Any]:
        return {
            "is_level": self.is_level,
            "is_cap": self.is_cap,
            "rs_level": self.rs_level,
            "rs_band": self.rejection_band,
            "veto": self.veto,
        }

    def weight_sums(self, logp_prox: Tensor, logp_behav: Tensor | None, mask: Tensor) -> Tensor:
        """`[2]` float64: Σ w over the kept loss tokens of this micro-batch (before any
        normalisation), and their count; summed over the optimiser batch on every rank, their
        ratio is `weight_mean`."""
        got = correct(logp_prox, logp_behav, mask, **self.options())
        kept = zero_outside(got.weights, got.mask).sum()
        return torch.stack([kept, got.mask.sum()]).double()


class IcePopCorrection(_CorrectionMethod):
    """IcePop: a two-sided token mask [low, high]; inside it the token is weighted by its full
    ratio ρ_t (no truncation), outside it leaves the loss. With an optional veto."""

    method: Literal["icepop"] = Field(
        "icepop", description="icepop: the two-sided token band, full ratio inside it."
    )
    low: float = Field(0.5, gt=0.0, description="α, the bottom of the band.")
    high: float = Field(5.0, gt=0.0, description="β, the top of the band.")
    veto: float | None = Field(
        None, gt=0.0, lt=1.0, description="τ_veto, as for the rollout method; null: off."
    )

    @model_validator(mode="after")
    def _band_is_a_band(self) -> IcePopCorrection:
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        return self

    def options(self) -> dict[str, Any]:
        return {"icepop": (self.low, self.high), "veto": self.veto}


class NoCorrection(_CorrectionMethod):
    """No correction: w = 1 and nothing rejected. Sound only when the generator and the
    learner compute the same log-probs and max_staleness = 0; the mismatch metrics still
    show the gap."""

    method: Literal["none"] = Field("none", description="none: no correction.")

    def options(self) -> dict[str, Any]:
        return {"is_level": "none"}


CorrectionConfig = Annotated[
    Annotated[RolloutCorrection, Tag("rollout")]
    | Annotated[IcePopCorrection, Tag("icepop")]
    | Annotated[NoCorrection, Tag("none")],
    tag_or("method", "rollout"),
]


CORRECTION_CLASSES = tagged_classes(CorrectionConfig, "method")


def correction_of_importance(importance: Any) -> dict[str, Any]:
    """The `algorithm.correction` block that the older `algorithm.importance: {mode, cap}`
    spelled: tis = token-level truncation at cap; mask = the same weight with the tokens above
    cap rejected (band [0, cap]); none = no correction."""
    if not isinstance(importance, Mapping):
        raise ValueError(
            f"algorithm.importance must be a mapping {{mode, cap}}, not {importance!r}; "
            "better, set algorithm.correction"
        )
    unknown = set(importance) - {"mode", "cap"}
    if unknown:
        raise ValueError(
            f"algorithm.importance has no field {', '.join(sorted(map(str, unknown)))}: it "
            "takes mode and cap; set algorithm.correction for the full menu"
        )
    mode, cap = importance.get("mode", "tis"), importance.get("cap", 2.0)
    if not isinstance(cap, int | float) or isinstance(cap, bool) or not 1.0 <= cap < math.inf:
        raise ValueError(f"algorithm.importance.cap must be a number ≥ 1 (got {cap!r})")
    if mode == "tis":
        return {"method": "rollout", "is_level": "token", "is_cap": cap}
    if mode == "mask":
        return {
            "method": "rollout",
            "is_level": "token",
            "is_cap": cap,
            "rs_level": "token",
            "rs_low": 0.0,
            "rs_high": cap,
        }
    if mode == "none":
        return {"method": "none"}
    raise ValueError(f"unknown algorithm.importance.mode {mode!r}; use tis, mask or none")
