"""Recipes: training in stages — a supervised warm start, then RL, then evaluation and export —
as one resumable sequence (the `recipe` flow, `flows.recipe`, runs it).

A recipe is a YAML file (bundled: `streamrl/recipes/<name>.yaml`, or a path) naming its stages
in order, each one of:

- `run`: a streamrl run, supervised (`sft` set) or RL, configured as `streamrl run` is — the
  stage's `presets` in order, the recipe's `overrides`, then the stage's. It starts from the
  model of `start_from` (default: the run stage before it, if any): that stage's last version,
  exported, is its `model.path`.
- `preference`: a run stage of the preference learner (DPO, IPO, SimPO: its presets set
  `preference`, docs/preference.md), on a pair dataset or a run's own scored groups.
- `eval`: `streamrl eval` of a run stage's last version (`of`) on a dataset (default: the
  run's held-out set), the result stored in the stage's folder.
- `export`: a run stage's last version (`of`) as a model directory.

Each stage has its own folder under the recipe's storage root, `<root>/<stage>`: a run stage's
run directory, an eval stage's `eval.json`, an export stage's model. A model a later stage
starts from is exported to a local folder (`models_dir`, default `<root>/models` for a local
root), since models load from local directories; after a move to another machine it is
exported again from the stage's run. `models_dir` must lie apart from the root and the stages'
folders (`streamrl.recipes.folders`).

Reading a recipe: `streamrl.recipes.recipe`; checking it whole against a root before anything
starts, and telling finished stages: `streamrl.recipes.plan`.
"""

from streamrl.recipes.plan import (
    EVAL_RESULT,
    EXPORTED_FROM,
    RecipePlan,
    StagePlan,
    exported_from,
    plan_recipe,
)
from streamrl.recipes.recipe import (
    EvalStage,
    ExportStage,
    PreferenceStage,
    Recipe,
    RunStage,
    available_recipes,
    load_recipe,
)

__all__ = [
    "EVAL_RESULT",
    "EXPORTED_FROM",
    "EvalStage",
    "ExportStage",
    "PreferenceStage",
    "Recipe",
    "RecipePlan",
    "RunStage",
    "StagePlan",
    "available_recipes",
    "exported_from",
    "load_recipe",
    "plan_recipe",
]
