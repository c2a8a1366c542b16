"""The `data` section: the prompt dataset (`streamrl.data.datasets` reads it); `eval.dataset`
has the same fields.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from streamrl.config.base import MAX_SEED, MAX_SEQUENCE_TOKENS, Section
from streamrl.data.reasoning_gym import REASONING_GYM_PREFIX, ReasoningGymConfig

__all__ = [
    "DataConfig",
]


class DataConfig(Section):
    """The prompt dataset."""

    path: str = Field(
        "builtin:arithmetic",
        min_length=1,
        description="JSONL or Parquet file (local or fsspec URL, e.g. s3://...), a bundled "
        "dataset: builtin:arithmetic (its held-out split: builtin:arithmetic-test), "
        "builtin:math, reasoning-gym tasks: reasoning_gym:<task>[,<task>...] (set up in "
        "data.reasoning_gym), or the dataset of the verifiers environment "
        "(generator.env.verifiers): verifiers:train, verifiers:eval. Also read as data.source, "
        "which wins over a data.path beside it (a preset's).",
    )
    format: Literal["auto", "jsonl", "parquet"] = Field(
        "auto", description="File format; auto infers it from the extension."
    )
    prompt_field: str = Field(
        "prompt",
        min_length=1,
        description="Field with the prompt: a string or a list of chat messages (verl layout). "
        "Dotted paths reach into nested fields.",
    )
    answer_field: str | list[str] = Field(
        "reward_model.ground_truth",
        min_length=1,
        description="Field with the ground-truth answer (dotted path; verl/DAPO-Math-17k layout "
        "by default); a list of fields gives the reward a JSON object of their values by path "
        "(LiveCodeBench's public_test_cases, private_test_cases and metadata).",
    )

    @property
    def answer_fields(self) -> tuple[str, ...]:
        """The answer's fields, as dotted paths."""
        return (
            (self.answer_field,) if isinstance(self.answer_field, str) else tuple(self.answer_field)
        )

    system_prompt: str | None = Field(
        None, description="System message prepended to every prompt, if any."
    )
    apply_chat_template: bool = Field(
        True, description="Format prompts with the tokenizer's chat template."
    )
    max_prompt_len: int = Field(
        512,
        gt=0,
        le=MAX_SEQUENCE_TOKENS,
        description="Prompts longer than this many tokens are dropped and counted.",
    )
    shuffle_seed: int = Field(
        0,
        ge=0,
        le=MAX_SEED,
        description="Seed of the per-epoch shuffle (deterministic across restarts).",
    )
    val_path: str | None = Field(
        None, description="Held-out validation set (same layout), for evaluation."
    )
    task_field: str | None = Field(
        "data_source",
        min_length=1,
        description="Field naming the task a row belongs to (verl's data_source; a "
        "reasoning-gym row's task), recorded with its group so metrics, streamrl status and "
        "streamrl eval break accuracy down per task. A row without it has none; null: none.",
    )
    reasoning_gym: ReasoningGymConfig = Field(
        default_factory=ReasoningGymConfig,
        description="The reasoning-gym tasks' weights, settings and splits, when data.path "
        "names reasoning_gym:<task>,...",
    )

    @model_validator(mode="before")
    @classmethod
    def _source_is_path(cls, data: Any) -> Any:
        """`source` as `path`: presets set `path`, so a `source` the user layers on top wins."""
        if isinstance(data, dict) and "source" in data:
            data = {**{k: v for k, v in data.items() if k != "source"}, "path": data["source"]}
        return data

    @property
    def procedural(self) -> bool:
        """Whether the prompts are generated (reasoning-gym tasks), not read from a file."""
        return self.path.startswith(REASONING_GYM_PREFIX)
