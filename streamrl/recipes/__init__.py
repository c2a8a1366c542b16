"""Recipes: training in stages — a supervised warm start, then RL, then evaluation and export —
as one resumable sequence (the `recipe` flow, `flows.recipe`, runs it).

A recipe is a YAML file (bundled: `streamrl/recipes/<name>.yaml`, or a path) naming its stages
in order, each one of:

- `run`: a streamrl run, supervised (`sft` set) or RL, configured as `streamrl run` is — the
  stage's `presets` in order, the recipe's `overrides`, then the stage's. It starts from the
  model of `start_from` (default: the run stage before it, if any): that stage's last version,
  exported, is its `model.path`.
- `eval`: `streamrl eval` of a run stage's last version (`of`) on a dataset (default: the
  run's held-out set), the result stored in the stage's folder.
- `export`: a run stage's last version (`of`) as a model directory.

Each stage has its own folder under the recipe's storage root, `<root>/<stage>`: a run stage's
run directory, an eval stage's `eval.json`, an export stage's model. A model a later stage
starts from is exported to a local folder (`models_dir`, default `<root>/models` for a local
root), since models load from local directories; after a move to another machine it is
exported again from the stage's run.

`plan_recipe` checks the whole recipe before anything starts: every run stage's configuration
is validated (a bad field in stage 3 is refused before stage 1 runs), every `of` and
`start_from` names an earlier run stage, names are unique. `StagePlan.done` tells a finished
stage (a run whose learner reached its step budget; an eval with its result; an export with its
model), so a recipe resumed after a crash skips finished stages and resumes the one that was
running from its checkpoint.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from storage.fs import open_location
from streamrl.config.base import ConfigError, Section
from streamrl.config.loading import load_config
from streamrl.config.run import RunConfig

__all__ = [
    "EvalStage",
    "ExportStage",
    "Recipe",
    "RecipePlan",
    "RunStage",
    "StagePlan",
    "available_recipes",
    "load_recipe",
    "plan_recipe",
]

STAGE_NAME = re.compile(r"[a-z][a-z0-9_-]{0,39}")
"""A stage's name: its folder under the recipe's root."""

EVAL_RESULT = "eval.json"  # in an eval stage's folder
EXPORTED_FROM = "exported-from.json"  # in an exported model's folder: which run and version


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


Stage = Annotated[RunStage | EvalStage | ExportStage, Field(discriminator="kind")]


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


@dataclass
class StagePlan:
    """One stage, resolved: its folder (`uri`), and for a run stage its configuration, the
    presets and overrides that make it, and the stage whose exported model it starts from
    (`start_from`, None: the configured model)."""

    stage: RunStage | EvalStage | ExportStage
    uri: str
    config: RunConfig | None = None
    presets: list[str] = field(default_factory=list)  # a run stage's, as its run takes them
    overrides: list[str] = field(default_factory=list)
    start_from: str | None = None
    export_to: str | None = None  # where this run stage's last version is exported for others

    @property
    def name(self) -> str:
        return self.stage.name

    def done(self) -> bool:
        """Whether the stage finished (module docstring)."""
        location = open_location(self.uri, check=False)  # reading only: nothing created
        if isinstance(self.stage, RunStage):
            return _run_finished(self.uri)
        if isinstance(self.stage, EvalStage):
            return location.fs.exists(location.join(EVAL_RESULT))
        return Path(self.uri, "config.json").exists()

    def started(self) -> bool:
        """Whether a run stage's run exists (a resumed recipe resumes it)."""
        location = open_location(self.uri, check=False)
        return location.fs.exists(location.join("run.json"))


@dataclass
class RecipePlan:
    """A recipe resolved against a storage root: its stages in order."""

    name: str
    root: str
    models_dir: str
    recipe: Recipe
    stages: list[StagePlan] = field(default_factory=list)

    def stage(self, name: str) -> StagePlan:
        return next(s for s in self.stages if s.name == name)


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


def plan_recipe(
    name: str,
    recipe: Recipe,
    root: str,
    *,
    overrides: Sequence[str] = (),
    models_dir: str | None = None,
) -> RecipePlan:
    """`recipe` under the storage `root`, every stage checked (module docstring); `overrides`
    go to every run stage, last.

    Raises:
        ConfigError: every problem of every stage, each naming its stage.
    """
    root = root.rstrip("/")
    if models_dir is None:
        if "://" in root:
            raise ConfigError(
                [f"the recipe's root {root} is remote, but the models a stage starts from load "
                 "from a local folder: give models_dir (a local folder)"],
                "recipe",
            )  # fmt: skip
        models_dir = f"{root}/models"
    plan = RecipePlan(name, root, models_dir, recipe)
    problems: list[str] = []
    runs: list[str] = []
    seen: set[str] = set()
    for i, stage in enumerate(recipe.stages):
        where = f"stage {i + 1} ({stage.name})"
        if not STAGE_NAME.fullmatch(stage.name) or stage.name == "models":
            problems.append(f"{where}: a stage's name is lower case letters, digits, - and _ "
                            "(a folder name; not 'models')")  # fmt: skip
        if stage.name in seen:
            problems.append(f"{where}: another stage is named {stage.name!r}")
        seen.add(stage.name)
        step = StagePlan(stage, f"{root}/{stage.name}")
        if isinstance(stage, RunStage):
            start = runs[-1] if stage.start_from == "previous" and runs else stage.start_from
            if start == "previous":
                start = None
            if start is not None and start not in runs:
                problems.append(f"{where}: start_from={start!r} is not a run stage before it "
                                f"({', '.join(runs) or 'none'})")  # fmt: skip
                start = None
            step.start_from = start
            step.presets = list(stage.presets)
            step.overrides = [*recipe.overrides, *stage.overrides, *overrides,
                              f"storage.run_uri={step.uri}"]  # fmt: skip
            if start is not None:
                step.overrides.append(f"model.path={_model_dir(plan, start)}")
            try:
                step.config = load_config(step.presets, overrides=step.overrides)
            except ConfigError as error:
                problems += [f"{where}: {p}" for p in error.problems]
            runs.append(stage.name)
        elif stage.of not in runs:
            problems.append(f"{where}: of={stage.of!r} is not a run stage before it "
                            f"({', '.join(runs) or 'none'})")  # fmt: skip
        plan.stages.append(step)
    if problems:
        raise ConfigError(problems, f"recipe {name!r}")
    for step in plan.stages:
        if step.start_from is not None:
            plan.stage(step.start_from).export_to = _model_dir(plan, step.start_from)
    return plan


def _model_dir(plan: RecipePlan, stage: str) -> str:
    return f"{plan.models_dir}/{stage}"


def _run_finished(uri: str) -> bool:
    """Whether the run's learner reached its step budget (its last checkpoint is of it)."""
    from storage.checkpoints.dcp import CheckpointStore
    from streamrl.config.stored import load_run_config

    run = open_location(uri, check=False)
    if not run.fs.exists(run.join("run.json")):
        return False
    total = load_run_config(run).learner.total_steps
    return CheckpointStore(run).latest_verified() == total


def exported_from(model_dir: str) -> dict[str, Any] | None:
    """Which run and version a recipe exported into `model_dir`, or None."""
    marker = Path(model_dir, EXPORTED_FROM)
    if not marker.exists():
        return None
    try:
        record = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None
