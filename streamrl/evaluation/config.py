"""The `eval` section: held-out evaluation of published versions (`streamrl.evaluation`)."""

from __future__ import annotations

from pydantic import Field

from streamrl.config.base import MAX_STEPS, CoreSetting, Section
from streamrl.data.config import DataConfig

__all__ = ["EvalConfig"]


class EvalConfig(Section):
    """Held-out evaluation of published versions, in a process of its own (`streamrl eval`)."""

    dataset: DataConfig | None = Field(
        None,
        description="Validation prompts; fields left unset are taken from `data`, so "
        "eval.dataset.path=val.jsonl is enough. null: data.val_path, or when that is unset too "
        "the training prompts themselves (not held out: the evaluator warns and marks its "
        "records held_out=false).",
    )
    every_versions: int = Field(
        0,
        ge=0,
        le=MAX_STEPS,
        description="E: evaluate every E-th published version, and the last one; 0 starts no "
        "evaluator.",
    )
    k: int = Field(
        4,
        ge=1,
        le=4096,
        description="Samples per prompt for val/avg@k (mean accuracy of k samples).",
    )
    max_prompts: int = Field(
        64,
        ge=1,
        le=100_000_000,
        description="Evaluate the first this many validation prompts (file order).",
    )
    temperature: float | None = Field(
        None,
        gt=0.0,
        description="Sampling temperature of val/avg@k; null: generator.temperature. "
        "val/acc_greedy always decodes greedily.",
    )
    cpu_cores: CoreSetting = Field(
        None,
        description="CPU cores of the evaluator: a count or a core list such as '6-7'. null: "
        "every core no other component pins, at background priority (see streamrl.placement).",
    )
