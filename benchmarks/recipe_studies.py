"""The studies `benchmarks.recipe_study` runs: a bundled recipe against the same recipe changed
in one way, each arm's models evaluated before and after each stage.

- `calculator` (issue #47): `calculator-agent` (arm `tool`: a warm start on demonstrations of
  the calculator in use, then DAPO with the calculator environment) against the same recipe
  without the tool (arm `direct`: the warm start on the same problems' final answers, then DAPO
  single-turn with the math reward), evaluated on `builtin:calculator-test`.
- `preference` (issue #62): `sft-dpo-rl` (arm `dpo`: a warm start, DPO on
  `builtin:arithmetic-pairs`, then DAPO on `builtin:arithmetic`) against the same recipe without
  its DPO stage (arm `no-dpo`: the RL stage starts from the warm start), evaluated on
  `builtin:arithmetic-test`; the DPO stage's held-out pair metrics before (its first step's
  `initial/pref/eval_*`) and after (its last step's).

A study names, per arm, the models it evaluates (`Point`): the base model, a stage's exported
model, or a version of the RL stage (its last run stage): version 0 (the model it started from)
or its last.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["STUDIES", "Point", "Study", "mean_sd"]


@dataclass(frozen=True)
class Point:
    """A model evaluated: `source` is `base` (the first stage's configured model), `stage:<name>`
    (that stage's exported model), `rl:0` (the RL stage's initial weights) or `rl:last`."""

    name: str
    label: str
    source: str


@dataclass(frozen=True)
class Study:
    """A recipe, its arms (`recipe_for` makes an arm's run stages from the bundled recipe's),
    the held-out dataset its models are evaluated on, the models each arm evaluates, and the
    report's tables (`report`, given the finished cells)."""

    name: str
    recipe: str
    arms: tuple[str, ...]
    eval_dataset: str
    recipe_for: Callable[[str, dict[str, Any]], dict[str, Any]]
    points: Callable[[str], tuple[Point, ...]]
    report: Callable[[list[dict[str, Any]]], list[str]]
    markers: tuple[str, str]
    stage_keys: tuple[str, ...]  # what each stage's step records keep in a cell's result


def mean_sd(values: list[float], digits: int = 3) -> str:
    """Mean ± sample standard deviation (one value: itself)."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def _run_stages(recipe: dict[str, Any]) -> list[dict[str, Any]]:
    """The recipe's training stages (this study evaluates on its own)."""
    return [s for s in recipe["stages"] if s["kind"] in ("run", "preference")]


def _by_arm(cells: list[dict[str, Any]], arm: str) -> list[dict[str, Any]]:
    return sorted((c for c in cells if c["arm"] == arm), key=lambda c: c["seed"])


def _seeds(cells: list[dict[str, Any]]) -> str:
    return ",".join(str(c["seed"]) for c in cells)


def _footer(cells: list[dict[str, Any]], stages: str) -> str:
    """What was evaluated, and each cell's wall-clock."""
    prompts = sorted({(c["eval_prompts"], c["k"]) for c in cells})
    walls = ", ".join(f"{c['arm']}-s{c['seed']} {c['wall_s']:.0f} s"
                      + ("" if c["wall_comparable"] else " (resumed)") for c in cells)  # fmt: skip
    return (f"Held-out problems and samples per problem: {prompts}. Recipe wall-clock "
            f"({stages}, with their start-up): {walls}.")  # fmt: skip


def _cell_values(cells: list[dict[str, Any]], point: str, metric: str, digits: int = 3) -> str:
    values = [c["evaluations"][point].get(metric) for c in cells]
    return "—" if None in values else mean_sd([float(v) for v in values], digits)


# -- calculator (issue #47) ----------------------------------------------------------------------

CALCULATOR_METRICS = (
    "val/acc_greedy", "val/pass@1", "val/tool_use_frac", "val/tool_calls_mean",
    "val/tool_errors_mean", "val/turns_mean", "val/response_len_mean",
)  # fmt: skip


def _calculator_recipe(arm: str, recipe: dict[str, Any]) -> dict[str, Any]:
    """`tool`: the bundled recipe's run stages; `direct`: the same without the tool."""
    from streamrl.config.loading import load_config

    recipe = {**recipe, "stages": _run_stages(recipe)}
    if arm == "direct":
        max_tokens = load_config(["smollm2-cpu", "calculator"]).generator.max_tokens
        for stage in recipe["stages"]:
            stage["presets"] = [p for p in stage["presets"] if p != "calculator"]
            stage["overrides"] = [
                o.replace("builtin:calculator-demos", "builtin:calculator-answers")
                for o in stage["overrides"]
                if not o.startswith("sft.tools=")
            ] + [f"generator.max_tokens={max_tokens}"]
    return recipe


def _calculator_points(arm: str) -> tuple[Point, ...]:
    return (Point("base", "base", "base"), Point("sft", "after SFT", "rl:0"),
            Point("rl", "after RL", "rl:last"))  # fmt: skip


def _calculator_report(cells: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| arm | model | seeds | greedy | pass@1 | episodes calling the tool | tool calls "
        "| failed calls | turns | tokens |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in CALCULATOR.arms:
        mine = _by_arm(cells, arm)
        for point in _calculator_points(arm) if mine else ():
            row = [arm, point.label, _seeds(mine)]
            row += [_cell_values(mine, point.name, metric,
                                 1 if metric == "val/response_len_mean" else 3)
                    for metric in CALCULATOR_METRICS]  # fmt: skip
            lines.append("| " + " | ".join(row) + " |")
    return [*lines, "", _footer(cells, "SFT + RL")]


CALCULATOR = Study(
    name="calculator",
    recipe="calculator-agent",
    arms=("tool", "direct"),
    eval_dataset="builtin:calculator-test",
    recipe_for=_calculator_recipe,
    points=_calculator_points,
    report=_calculator_report,
    markers=("<!-- recipe-study:begin -->", "<!-- recipe-study:end -->"),
    stage_keys=(
        "step",
        "time",
        "loss",
        "heldout/loss",
        "rollout/acc",
        "rollout/tool_calls_mean",
        "rollout/turns_mean",
        "perf/step_s",
    ),
)


# -- preference (issue #62) ----------------------------------------------------------------------

PAIR_METRICS = ("accuracy", "likelihood_accuracy", "margin")
RL_WINDOW = 2  # RL steps averaged at its start and at its end


def _preference_recipe(arm: str, recipe: dict[str, Any]) -> dict[str, Any]:
    """`dpo`: the bundled recipe's run stages; `no-dpo`: without its preference stage (the RL
    stage starts from the warm start)."""
    stages = _run_stages(recipe)
    if arm == "no-dpo":
        stages = [s for s in stages if s["kind"] != "preference"]
    return {**recipe, "stages": stages}


def _preference_points(arm: str) -> tuple[Point, ...]:
    if arm == "no-dpo":
        return (Point("base", "base", "base"), Point("sft", "after SFT", "rl:0"),
                Point("rl", "after RL", "rl:last"))  # fmt: skip
    return (Point("base", "base", "base"), Point("sft", "after SFT", "stage:sft"),
            Point("dpo", "after DPO", "rl:0"), Point("rl", "after RL", "rl:last"))  # fmt: skip


def _pairs(cell: dict[str, Any], when: str) -> dict[str, float]:
    """The DPO stage's held-out pair metrics before it trained (`initial`) or at its end."""
    steps = cell["stages"]["dpo"]["steps"]
    if when == "initial":
        return {m: steps[0][f"initial/pref/eval_{m}"] for m in PAIR_METRICS}
    last = next(s for s in reversed(steps) if "pref/eval_accuracy" in s)
    return {m: last[f"pref/eval_{m}"] for m in PAIR_METRICS}


def _rl_acc(cell: dict[str, Any], end: bool) -> float:
    steps = [s["rollout/acc"] for s in cell["stages"]["rl"]["steps"] if "rollout/acc" in s]
    window = steps[-RL_WINDOW:] if end else steps[:RL_WINDOW]
    return statistics.mean(window)


def _preference_report(cells: list[dict[str, Any]]) -> list[str]:
    lines = ["| arm | model | seeds | greedy | pass@1 | tokens |", "|---|---|---|---|---|---|"]
    for arm in PREFERENCE.arms:
        mine = _by_arm(cells, arm)
        for point in _preference_points(arm) if mine else ():
            row = [arm, point.label, _seeds(mine),
                   _cell_values(mine, point.name, "val/acc_greedy"),
                   _cell_values(mine, point.name, "val/pass@1"),
                   _cell_values(mine, point.name, "val/response_len_mean", 1)]  # fmt: skip
            lines.append("| " + " | ".join(row) + " |")
    if dpo := _by_arm(cells, "dpo"):
        lines += ["", "Held-out pairs (`builtin:arithmetic-pairs-test`) in the DPO stage:", "",
                  "| model | seeds | pair accuracy | likelihood accuracy | margin |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for when, label in (("initial", "before DPO (after SFT)"), ("last", "after DPO")):
            values = [_pairs(c, when) for c in dpo]
            lines.append(f"| {label} | {_seeds(dpo)} | "
                         + " | ".join(mean_sd([v[m] for v in values]) for m in PAIR_METRICS)
                         + " |")  # fmt: skip
    rl_rows = [(arm, mine) for arm in PREFERENCE.arms if (mine := _by_arm(cells, arm))]
    if rl_rows:
        lines += ["", f"The RL stage's rollout accuracy (its first and last {RL_WINDOW} steps):",
                  "", "| arm | seeds | RL start | RL end |", "|---|---|---|---|"]  # fmt: skip
        for arm, mine in rl_rows:
            start = mean_sd([_rl_acc(c, end=False) for c in mine])
            end = mean_sd([_rl_acc(c, end=True) for c in mine])
            lines.append(f"| {arm} | {_seeds(mine)} | {start} | {end} |")
    return [*lines, "", _footer(cells, "every stage")]


PREFERENCE = Study(
    name="preference",
    recipe="sft-dpo-rl",
    arms=("dpo", "no-dpo"),
    eval_dataset="builtin:arithmetic-test",
    recipe_for=_preference_recipe,
    points=_preference_points,
    report=_preference_report,
    markers=("<!-- preference-study:begin -->", "<!-- preference-study:end -->"),
    stage_keys=(
        "step",
        "time",
        "sft/loss",
        "sft/heldout_loss",
        "initial/sft/heldout_loss",
        "pref/loss",
        "pref/accuracy",
        "pref/margin",
        *(f"{when}pref/eval_{m}" for when in ("", "initial/") for m in PAIR_METRICS),
        "rollout/acc",
        "rollout/reward_mean",
        "perf/step_s",
    ),
)

STUDIES = {study.name: study for study in (CALCULATOR, PREFERENCE)}
