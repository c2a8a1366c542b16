"""The `preference` section of a run: preference optimization (DPO, IPO, SimPO) on pairs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from streamrl.algorithms.preference import DEFAULT_BETA, PreferenceLoss
from streamrl.config.base import MAX_STEPS, Section

__all__ = ["PreferenceConfig"]


class PreferenceConfig(Section):
    """Preference optimization (`streamrl.learner.preference`): the run's learner trains on
    the (prompt, chosen, rejected) pairs of `data.path` (held-out pairs: `data.val_path`)
    instead of a replay stream; no generator runs. Batching (`learner.batch_groups` pairs a
    step, each pair one group of two responses sharing its prompt), optimiser, checkpoints,
    publishing and LoRA are the learner's own. The math: ALGORITHMS.md "Preference
    optimization"."""

    loss: PreferenceLoss = Field(
        "dpo",
        description="dpo: −log σ(β·Δ log-ratio), with label_smoothing; ipo: the squared "
        "distance of the length-averaged log-ratio difference to 1/(2β); simpo: "
        "reference-free, −log σ(β·(mean log-prob difference) − γ).",
    )
    beta: float | None = Field(
        None,
        gt=0.0,
        le=100.0,
        description="β (IPO's τ); null: 0.1 for dpo and ipo, 2.0 for simpo.",
    )
    label_smoothing: float = Field(
        0.0,
        ge=0.0,
        lt=0.5,
        description="dpo: ε, the assumed fraction of flipped labels (conservative DPO).",
    )
    simpo_gamma: float = Field(0.5, ge=0.0, le=100.0, description="simpo: the target margin γ.")
    reference: Literal["on_the_fly", "cached"] = Field(
        "on_the_fly",
        description="dpo, ipo: the reference's log-probs scored beside the policy at every step "
        "(on_the_fly), or of every pair (training and held-out) once before the first step and "
        "kept in the run's storage (cached: a resume reads them back, the reference model is "
        "released and steps run the policy alone; worth it from about one epoch on).",
    )
    nll_weight: float = Field(
        0.0,
        ge=0.0,
        le=100.0,
        description="α: adds α × the chosen response's token-mean negative log-likelihood "
        "(RPO); 0: off.",
    )
    pairs_from: str | None = Field(
        None,
        description="A run (its storage URI, reached with this run's storage settings) whose "
        "replay stream gives the training pairs: in each group the highest-reward response "
        "chosen, the lowest rejected, groups without a reward difference dropped; data.path is "
        "then not read. The first life records how far it read, so a resume trains on the same "
        "pairs while the source still runs.",
    )
    prompt_field: str | None = Field(
        "prompt",
        description="Field with the prompt: a string or chat messages; null: none (HH-RLHF, "
        "where chosen and rejected are whole conversations sharing the prompt).",
    )
    chosen_field: str = Field("chosen", min_length=1, description="Field with the chosen answer.")
    rejected_field: str = Field(
        "rejected", min_length=1, description="Field with the rejected answer."
    )
    eval_every: int = Field(
        10,
        ge=0,
        le=MAX_STEPS,
        description="Held-out pref/eval_* metrics on data.val_path every this many steps and at "
        "the last; 0: never.",
    )
    eval_pairs: int = Field(
        256, ge=1, le=1_000_000, description="Held-out pairs evaluated (the first this many)."
    )

    @property
    def resolved_beta(self) -> float:
        return self.beta if self.beta is not None else DEFAULT_BETA[self.loss]

    @property
    def needs_reference(self) -> bool:
        return self.loss != "simpo"
