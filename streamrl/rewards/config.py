"""The `generator.reward` section: the verifiable reward and the limits of its worker processes
(`streamrl.rewards.scoring`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

from pydantic import Field, field_validator, model_validator

from storage.stream.scored_group import REWARD_TERM_NAME
from streamrl.config.base import MAX_WAIT_S, Section
from streamrl.data.rows import DatasetError
from streamrl.rewards.code.cases import TestSpecError, read_tests
from streamrl.rewards.code.config import CodeRewardConfig
from streamrl.rewards.code.reward import box_wall_s
from streamrl.rewards.registry import RewardSpec, check_reward_name
from streamrl.scorers.terms import ModelTerm

__all__ = [
    "RewardConfig",
]

_BOX_START_S = 2.0  # the box and its harness starting, on a loaded machine


class RewardConfig(Section):
    """The reward a generator scores responses with: the verifiable rule (`fn`) and, when
    `models` names any, terms scored by models, R = weight·R_rule + Σ c_k·R_k."""

    fn: str = Field(
        "math",
        description="A registered reward name (math, format, ...) or a user function by import "
        "path 'package.module:function'.",
    )
    timeout_s: float = Field(
        10.0,
        gt=0.0,
        le=MAX_WAIT_S,
        description="Per-call time limit; a call that exceeds it fails (on_error).",
    )
    workers: int = Field(2, ge=1, le=1024, description="Processes scoring responses in parallel.")
    memory_mb: int = Field(
        4096,
        ge=256,
        le=1024**2,
        description="Address-space limit (RLIMIT_AS) of each reward worker, MiB: an allocation "
        "beyond it fails and the call counts as failed (on_error). Counts virtual memory, "
        "which threads and mapped files take too.",
    )
    nice: int = Field(
        10,
        ge=0,
        le=19,
        description="How many steps below the generator's CPU priority its reward workers "
        "and the programs they start run (Unix nice; 0: the same). Where they share cores with "
        "sampling (a CPU generator) sampling gets them first; code tests' time limits count "
        "CPU time, so a test waiting for a core does not time out.",
    )
    startup_timeout_s: float = Field(
        120.0,
        gt=0.0,
        le=MAX_WAIT_S,
        description="Time for reward workers to start and import the reward's module. Past "
        "it a starting generator fails naming the reward; workers restarted mid-run count the "
        "calls waiting for them as failed (on_error) and are tried again next batch.",
    )
    on_error: Literal["drop_group", "score_zero"] = Field(
        "drop_group",
        description="A group with a reward call that raised or timed out: drop_group leaves it "
        "out of the stream, score_zero trains on it with 0 for the failed responses (as wrong). "
        "Both count the failures in the stream's commit records (shown by `streamrl status`).",
    )

    code: CodeRewardConfig = Field(
        default_factory=CodeRewardConfig,
        description="The code reward's settings (fn: code): tests, layout, limits.",
    )
    weight: float = Field(
        1.0,
        ge=0.0,
        description="c of the rule term (fn) in R = Σ_k c_k·R_k when `models` add terms; 0 "
        "logs it (accuracy) without training on it.",
    )
    models: dict[str, ModelTerm] = Field(
        default_factory=dict,
        description="Reward terms scored by models, by term name: kind reward_model (a "
        "sequence classifier's score) or judge (an LLM's verdict on a rubric), each naming a "
        "scorer (scorers.<name>) and its weight c_k. Each term is logged as reward/<name>_mean.",
    )
    correctness: str | None = Field(
        None,
        description="The term whose raw score says a response is correct (≥ 1): accuracy and "
        "dynamic sampling read it. null: the rule term (fn).",
    )

    @property
    def rule_term(self) -> str:
        """The rule term's name: `fn` when it is a registered name, else 'rule'."""
        return self.fn if REWARD_TERM_NAME.fullmatch(self.fn) else "rule"

    @property
    def correctness_term(self) -> str:
        return self.correctness or self.rule_term

    @property
    def failed_call_outcome(self) -> str:
        """What a generator does with a response whose episode or reward call failed, in a
        warning's words (`on_error`)."""
        if self.on_error == "drop_group":
            return "its group is dropped (generator.reward.on_error=drop_group)"
        return "it is trained on with score 0 (generator.reward.on_error=score_zero)"

    @field_validator("models")
    @classmethod
    def _term_names(cls, value: dict[str, ModelTerm]) -> dict[str, ModelTerm]:
        for name in value:
            if not REWARD_TERM_NAME.fullmatch(name) or name == "rule":
                raise ValueError(
                    f"reward term name {name!r} must be lower-case letters, digits and _, "
                    "starting with a letter (and not 'rule'): it names the metric "
                    f"reward/{name}_mean"
                )
        return value

    @model_validator(mode="after")
    def _terms_are_distinct_and_correctness_is_one(self) -> RewardConfig:
        if self.rule_term in self.models:
            raise ValueError(
                f"generator.reward.models.{self.rule_term} has the rule term's name "
                f"(generator.reward.fn={self.fn}); rename the model term"
            )
        terms = [self.rule_term, *self.models]
        if self.correctness is not None and self.correctness not in terms:
            raise ValueError(
                f"generator.reward.correctness={self.correctness} names no term; the terms are "
                f"{', '.join(terms)}"
            )
        if not self.models and self.weight != 1.0:
            raise ValueError(
                "generator.reward.weight weighs the rule term against model terms "
                "(generator.reward.models), and there are none; remove it"
            )
        return self

    @model_validator(mode="after")
    def _code_tests_fit_in_a_call(self) -> RewardConfig:
        if self.fn != "code":
            return self
        needed = self.code.test_timeout_s + _BOX_START_S
        if box_wall_s(self.timeout_s) < needed:
            raise ValueError(
                f"generator.reward.timeout_s={self.timeout_s:g} leaves the code box less than "
                f"one test's time (generator.reward.code.test_timeout_s="
                f"{self.code.test_timeout_s:g}, and ~{_BOX_START_S:g}s to start it): raise "
                f"timeout_s to at least {math.ceil((needed + 1.0) / 0.95)}, or more for every test "
                "of a problem to fit (the box's whole wall clock, compiling included, stays "
                "within it)"
            )
        return self

    @field_validator("fn")
    @classmethod
    def _fn_is_name_or_import_path(cls, value: str) -> str:
        check_reward_name(value)  # imports nothing of the user's; a ValueError naming the fix
        return value

    def spec(self) -> RewardSpec:
        """What a reward worker loads (`streamrl.rewards.registry.resolve_reward`)."""
        return RewardSpec(self.fn, self.code, self.timeout_s)

    def check_ground_truths(self, rows: Iterable[tuple[str, str]], field: str) -> None:
        """Before any response is scored: for the `code` reward, every row's tests can be read
        (`rows`: prompt id and ground truth). Other rewards read theirs when scoring.

        Raises:
            DatasetError: naming the row, the field (`field`: `data.answer_field`) and what
                is wrong, as for any other dataset a user must fix.
        """
        if self.fn != "code":
            return
        for prompt_id, ground_truth in rows:
            try:
                read_tests(ground_truth, self.code.layout)
            except TestSpecError as error:
                raise DatasetError(
                    f"row {prompt_id}, field {field!r} ({self.code.layout} layout): {error}"
                ) from None
