"""The `recipe` flow: a training recipe's stages in order, each a child flow run.

    prefect deployment run recipe/calculator-agent --watch
    prefect deployment run recipe/calculator-agent -p root=./runs/agent -p resume=true
    prefect deployment run recipe/sft-dpo-rl --watch

Parameters: `name` (a bundled recipe, `streamrl/recipes/<name>.yaml`, or a recipe file), `root`
(the storage root: one folder per stage under it; default `./runs/recipe-<name>-<time>`),
`overrides` (dotted, given to every run stage last), `models_dir` (where the models a stage
starts from are exported: a local folder; default `<root>/models`), `resume` (go on with the
recipe already under `root`).

The whole recipe is checked before anything starts (`streamrl.recipes.plan_recipe`): a bad
field in any stage fails the flow run naming the stage and the field. Then each stage, in
order, is a child flow run — a run stage the `streamrl` flow (`flows.run`: its processes
supervised as ever), an eval stage `recipe-eval`, an export stage `recipe-export` — and a run
stage that a later one starts from is exported when it finishes. Resumed, finished stages are
skipped (said in the log and the stage artifact) and the stage that was running resumes from
its checkpoint. A stage that fails fails the recipe with its reason; nothing after it runs.
Artifacts: one markdown table of the stages (state, folder, result) refreshed as they go.
"""

# No `from __future__ import annotations`: Prefect validates the flow's parameter annotations.
import json
import re
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from flows.run import streamrl_run
from storage.fs import open_location, replace_object
from storage.weights.versions import WeightStore
from streamrl.config.loading import Override
from streamrl.config.stored import load_run_config
from streamrl.recipes import (
    EVAL_RESULT,
    EXPORTED_FROM,
    EvalStage,
    ExportStage,
    RecipePlan,
    RunStage,
    StagePlan,
    exported_from,
    load_recipe,
    plan_recipe,
)
from streamrl.runs.export import export_version

__all__ = ["evaluate_stage", "export_stage", "recipe"]


@flow(name="recipe", log_prints=True)
def recipe(
    name: str = "calculator-agent",
    root: str | None = None,
    overrides: list[Override] | None = None,
    models_dir: str | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    """Run (or resume) recipe `name` under `root` (module docstring); each stage's result."""
    logger = get_run_logger()
    recipe_name, spec = load_recipe(name)
    if root is None:
        if resume:
            raise ValueError("resume=true needs the root of the recipe to resume")
        root = f"./runs/recipe-{recipe_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    plan = plan_recipe(recipe_name, spec, root, overrides=overrides or [], models_dir=models_dir)
    if not resume and any(step.started() or step.done() for step in plan.stages):
        raise ValueError(
            f"recipe {recipe_name} already has stages under {plan.root}; resume it "
            "(resume=true) or give another root"
        )
    logger.info("recipe %s: %d stages under %s", recipe_name, len(plan.stages), plan.root)
    results: dict[str, Any] = {}
    for step in plan.stages:
        if step.done():
            logger.info("stage %s: finished before, skipped", step.name)
            results[step.name] = {"state": "skipped (finished before)"}
        else:
            logger.info("stage %s: %s", step.name, _what(step))
            results[step.name] = _run_stage(plan, step)
        if step.export_to is not None:
            _export_for_later(step)
        _artifact(plan, results)
    return results


def _run_stage(plan: RecipePlan, step: StagePlan) -> dict[str, Any]:
    stage = step.stage
    if isinstance(stage, RunStage):
        summary = streamrl_run.with_options(flow_run_name=f"{plan.name}-{step.name}")(
            preset=step.presets[0],
            size=None,
            extra_presets=step.presets[1:],
            overrides=step.overrides,
            run_uri=step.uri,
            resume=step.started(),
        )
        return {"state": "finished", "steps": summary["steps"], "run": step.uri}
    source = plan.stage(stage.of).uri
    if isinstance(stage, EvalStage):
        return evaluate_stage.with_options(flow_run_name=f"{plan.name}-{step.name}")(
            source, step.uri, dataset=stage.dataset, k=stage.k, max_prompts=stage.max_prompts
        )
    return export_stage.with_options(flow_run_name=f"{plan.name}-{step.name}")(
        source, step.uri, dtype=stage.dtype
    )


@flow(name="recipe-eval", log_prints=True)
def evaluate_stage(
    run_uri: str,
    out_uri: str,
    dataset: str | None = None,
    k: int | None = None,
    max_prompts: int | None = None,
) -> dict[str, Any]:
    """`streamrl eval` of the run's last version; the metrics also written to
    `<out_uri>/eval.json` (what marks the stage finished)."""
    from streamrl.evaluation.evaluator import evaluate  # vLLM: only where an eval stage runs

    run = open_location(run_uri)
    data = None
    if dataset is not None:
        config = load_run_config(run)
        base = (config.eval.dataset or config.data).model_copy(update={"path": dataset})
        data = base.model_copy(update={"val_path": None})
    metrics = evaluate(run, dataset=data, k=k, max_prompts=max_prompts, record=True)
    out = open_location(out_uri)
    replace_object(out, out.join(EVAL_RESULT), json.dumps(metrics, indent=1).encode())
    version, line = metrics.get("version"), eval_line(metrics)
    get_run_logger().info("evaluated %s v%s: %s", run_uri, version, line)
    return {"state": "finished", **metrics}


def eval_line(metrics: dict[str, Any]) -> str:
    """An evaluation's metrics in one line: accuracies, and what the agent did (if anything)."""
    avg = [key for key in metrics if key.startswith("val/avg@")]
    k = int(avg[0].removeprefix("val/avg@")) if avg else 1
    line = f"greedy {metrics['val/acc_greedy']:.3f}, pass@1 {metrics['val/pass@1']:.3f}"
    if k > 1:
        line += f", pass@{k} {metrics[f'val/pass@{k}']:.3f}"
    line += f" over {int(metrics['val/num_prompts'])} prompts"
    if "val/tool_use_frac" in metrics:
        line += (f"; the tool called in {metrics['val/tool_use_frac']:.1%} of episodes, "
                 f"{metrics['val/tool_calls_mean']:.2f} calls and "
                 f"{metrics['val/tool_errors_mean']:.2f} failed per episode")  # fmt: skip
    return line


@flow(name="recipe-export", log_prints=True)
def export_stage(run_uri: str, out_dir: str, dtype: str | None = None) -> dict[str, Any]:
    """The run's last version as a model directory at `out_dir`."""
    return {"state": "finished", **_export(run_uri, out_dir, dtype)}


def _export_for_later(step: StagePlan) -> None:
    """A run stage a later one starts from: its last version at `step.export_to`, unless
    that is there already (a resumed recipe on the same machine)."""
    assert step.export_to is not None
    latest = WeightStore(open_location(step.uri)).latest_version()
    if exported_from(step.export_to) == {"run": step.uri, "version": latest}:
        return
    _export(step.uri, step.export_to, None, overwrite=True)


def _export(run_uri: str, out_dir: str, dtype: str | None, overwrite: bool = False) -> dict:
    run = open_location(run_uri)
    version = WeightStore(run).latest_version()
    out = export_version(run, out_dir, version, overwrite=overwrite, dtype=dtype)
    record = {"run": run_uri, "version": version}
    (Path(out) / EXPORTED_FROM).write_text(json.dumps(record))
    get_run_logger().info("exported %s v%s to %s", run_uri, version, out)
    return {"model": str(out), **record}


def _what(step: StagePlan) -> str:
    stage = step.stage
    if isinstance(stage, RunStage):
        begin = f"from stage {step.start_from}" if step.start_from else "from its model.path"
        only = step.config.learner_only if step.config else None
        kind = f"{only} run" if only else "RL run"
        resumed = ", resumed" if step.started() else ""
        return f"{kind} {begin}{resumed}, in {step.uri}"
    if isinstance(stage, ExportStage):
        return f"export of stage {stage.of} to {step.uri}"
    return f"evaluation of stage {stage.of}"


def _artifact(plan: RecipePlan, results: dict[str, Any]) -> None:
    lines = ["| stage | kind | state | folder | result |", "|---|---|---|---|---|"]
    for step in plan.stages:
        result = results.get(step.name, {"state": "to come"})
        shown = ", ".join(
            f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
            for k, v in result.items()
            if k not in ("state", "run") and not isinstance(v, dict)
        )
        lines.append(
            f"| {step.name} | {step.stage.kind} | {result['state']} | {step.uri} | {shown} |"
        )
    key = "recipe-" + re.sub(r"[^a-z0-9-]+", "-", plan.name.lower())
    create_markdown_artifact("\n".join(lines), key=key, description=f"recipe {plan.name}: stages")
