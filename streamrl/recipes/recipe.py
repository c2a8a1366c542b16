"""A recipe file: its stages, in order, and how it is read (`load_recipe`).

A recipe is a YAML file (bundled: `streamrl/recipes/<name>.yaml`, or a path) naming its stages
in order, each one of `run` (the default kind), `preference`, `eval` and `export`
(`streamrl.recipes` says what each does). Reading one checks its shape only: which folders the
stages use and whether their runs' configurations hold is `streamrl.recipes.plan.plan_recipe`'s
to check.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from streamrl.config.base import ConfigError, Section

__all__ = [
    "STAGE_NAME",
    "EvalStage",
    "ExportStage",
    "PreferenceStage",
    "Recipe",
    "RunStage",
    "Stage",
    "available_recipes",
    "load_recipe",
]

STAGE_NAME = re.compile(r"[a-z][a-z0-9_-]{0,39}")
"""A stage's name: its folder under the recipe's root."""


class _Stage(Section):
    name: str = Field(
        min_length=1,
        max_length=40,
        description="The stage's name (lower case, digits, - and _): its folder under the "
        "recipe's root.",
    )


class RunStage(_Stage):
    """A streamrl run: supervised (`sft` set by its presets) or RL."""

    kind: Literal["run"] = Field("run", description="A run stage (the default kind).")
    presets: list[str] = Field(
        min_length=1, description="Presets, as streamrl run --preset takes them, in order."
    )
    overrides: list[str] = Field(
        default_factory=list, description="Dotted overrides, after the recipe's."
    )
    start_from: str | None = Field(
        "previous",
        description="The run stage whose last version this run starts from (its model.path): "
        "previous (the run stage before it, if any), a stage's name, or null (the configured "
        "model.path).",
    )


class PreferenceStage(RunStage):
    """A streamrl run of the preference learner: its presets set `preference` (dpo, ipo,
    simpo); otherwise a run stage."""

    kind: Literal["preference"] = Field(description="A preference stage (DPO, IPO, SimPO).")


class EvalStage(_Stage):
    """`streamrl eval` of a run stage's last version."""

    kind: Literal["eval"] = Field(description="An evaluation stage.")
    of: str = Field(description="The run stage evaluated.")
    dataset: str | None = Field(
        None, description="Dataset to evaluate on (default: the run's eval.dataset, else data)."
    )
    k: int | None = Field(None, ge=1, le=1024, description="Samples per prompt (eval.k).")
    max_prompts: int | None = Field(None, ge=1, description="At most this many prompts.")


class ExportStage(_Stage):
    """A run stage's last version as a model directory, `<root>/<name>`."""

    kind: Literal["export"] = Field(description="An export stage.")
    of: str = Field(description="The run stage exported.")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="Dtype of the exported weights (default: as published)."
    )


Stage = Annotated[RunStage | PreferenceStage | EvalStage | ExportStage, Field(discriminator="kind")]


class Recipe(Section):
    """Stages run in order (module docstring)."""

    description: str = Field("", description="What the recipe trains, in a sentence or two.")
    overrides: list[str] = Field(
        default_factory=list, description="Dotted overrides every run stage takes first."
    )
    stages: list[Stage] = Field(min_length=1, description="The stages, in order.")

    @model_validator(mode="before")
    @classmethod
    def _run_is_the_default_kind(cls, data: Any) -> Any:
        """A stage without `kind` is a run stage."""
        if isinstance(data, dict) and isinstance(data.get("stages"), list):
            stages = [{"kind": "run", **s} if isinstance(s, dict) and "kind" not in s else s
                      for s in data["stages"]]  # fmt: skip
            return {**data, "stages": stages}
        return data


def available_recipes() -> list[str]:
    """Names of the recipes shipped with streamrl."""
    folder = resources.files("streamrl") / "recipes"
    return sorted(
        p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml")
    )


def load_recipe(name_or_path: str) -> tuple[str, Recipe]:
    """A bundled recipe by name, or a recipe file: (its name, the recipe).

    Raises:
        ConfigError: no such recipe, not YAML, or a field that is wrong (named).
    """
    path = Path(name_or_path)
    if name_or_path in available_recipes():
        text = (resources.files("streamrl") / "recipes" / f"{name_or_path}.yaml").read_text()
        name = name_or_path
    elif path.suffix in (".yaml", ".yml") and path.is_file():
        text, name = path.read_text(), path.stem
    else:
        raise ConfigError(
            [f"no recipe {name_or_path!r}: give a bundled recipe "
             f"({', '.join(available_recipes()) or 'none'}) or a recipe's YAML file"],
            "recipe",
        )  # fmt: skip
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError([f"recipe {name!r} is not valid YAML{where}"], "recipe") from None
    try:
        return name, Recipe.model_validate(data)
    except ValidationError as exc:
        problems = [
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        ]  # fmt: skip
        raise ConfigError(problems, f"recipe {name!r}") from None
