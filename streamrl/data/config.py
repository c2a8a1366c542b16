"""The `data` section: the prompt dataset (`streamrl.data.datasets` reads it); `eval.dataset`
has the same fields.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from streamrl.config.base import MAX_SEED, MAX_SEQUENCE_TOKENS, Section

__all__ = [
    "DataConfig",
]


class DataConfig(Section):
    """The prompt dataset."""

    path: str = Field(
        "builtin:arithmetic",
        min_length=1,
        description="JSONL or Parquet file (local or fsspec URL, e.g. s3://...), or a bundled "
        "dataset: builtin:arithmetic (its held-out split: builtin:arithmetic-test), "
        "builtin:math.",
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
