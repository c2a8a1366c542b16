"""A recipe resolved against a storage root (`plan_recipe`): each stage's folder, each run
stage's configuration, and where the models later stages start from are exported.

`plan_recipe` checks the whole recipe before anything starts: every run stage's configuration
is validated (a bad field in stage 3 is refused before stage 1 runs), every `of` and
`start_from` names an earlier run stage, names are unique, and the exported models' folder
(`models_dir`) lies apart from the recipe's root and its stages' folders
(`streamrl.recipes.folders`). A run's kind says what it trains: a `preference` stage's
configuration sets `preference`, a `run` stage's does not. `StagePlan.done` tells a finished
stage (a run whose learner reached its step budget; an eval with its result; an export with its
model), so a recipe resumed after a crash skips finished stages and resumes the one that was
running from its checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from storage.fs import open_location
from streamrl.config.base import ConfigError
from streamrl.config.loading import load_config
from streamrl.config.run import RunConfig
from streamrl.recipes.folders import overlapping_folders
from streamrl.recipes.recipe import (
    STAGE_NAME,
    EvalStage,
    ExportStage,
    PreferenceStage,
    Recipe,
    RunStage,
)

__all__ = [
    "EVAL_RESULT",
    "EXPORTED_FROM",
    "RecipePlan",
    "StagePlan",
    "exported_from",
    "plan_recipe",
]

EVAL_RESULT = "eval.json"  # in an eval stage's folder
EXPORTED_FROM = "exported-from.json"  # in an exported model's folder: which run and version


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


def plan_recipe(
    name: str,
    recipe: Recipe,
    root: str,
    *,
    overrides: Sequence[str] = (),
    models_dir: str | None = None,
) -> RecipePlan:
    """`recipe` under the storage `root`, every stage checked (module docstring); `overrides`
    go to every run stage, last; `models_dir` (default `<root>/models`) receives the models
    later stages start from.

    Raises:
        ConfigError: every problem of every stage, each naming its stage, and a `models_dir`
            that overlaps the root or a stage's folder (naming both).
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
            else:
                problems += _kind_problems(where, stage, step.config)
            runs.append(stage.name)
        elif stage.of not in runs:
            problems.append(f"{where}: of={stage.of!r} is not a run stage before it "
                            f"({', '.join(runs) or 'none'})")  # fmt: skip
        plan.stages.append(step)
    problems += overlapping_folders(root, models_dir, [stage.name for stage in recipe.stages])
    if problems:
        raise ConfigError(problems, f"recipe {name!r}")
    for step in plan.stages:
        if step.start_from is not None:
            plan.stage(step.start_from).export_to = _model_dir(plan, step.start_from)
    return plan


def _kind_problems(where: str, stage: RunStage, config: RunConfig) -> list[str]:
    """A preference stage trains pairs, a run stage does not (one way to write each)."""
    preference = config.preference is not None
    if isinstance(stage, PreferenceStage) and not preference:
        return [f"{where}: a preference stage's presets set the preference section: add one of "
                "the presets dpo, ipo, simpo"]  # fmt: skip
    if not isinstance(stage, PreferenceStage) and preference:
        return [f"{where}: its presets set the preference section: make it `kind: preference`"]
    return []


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
