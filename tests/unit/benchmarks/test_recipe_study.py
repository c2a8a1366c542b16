"""The recipe studies (`benchmarks.recipe_study`, `benchmarks.recipe_studies`) without training:
each arm's recipe is the bundled one changed in the one way the arm names, it plans, each model
is measured by the engine it needs, and the tables read the cells' figures."""

from __future__ import annotations

import yaml

from benchmarks.recipe_studies import CALCULATOR, PREFERENCE, Point
from benchmarks.recipe_study import engines, recipe_file, rl_stage
from streamrl.recipes import load_recipe, plan_recipe


def _plan(tmp_path, study, arm):
    path = recipe_file(study, arm, tmp_path)
    name, recipe = load_recipe(str(path))
    return yaml.safe_load(path.read_text()), plan_recipe(name, recipe, str(tmp_path / arm))


def test_the_preference_arms_differ_by_the_dpo_stage_alone(tmp_path):
    with_dpo, plan = _plan(tmp_path, PREFERENCE, "dpo")
    without, plain = _plan(tmp_path, PREFERENCE, "no-dpo")
    assert [s.name for s in plan.stages] == ["sft", "dpo", "rl"]  # no eval, no export
    assert [s.name for s in plain.stages] == ["sft", "rl"]
    assert (plan.stage("rl").start_from, plain.stage("rl").start_from) == ("dpo", "sft")
    assert rl_stage(with_dpo) == rl_stage(without) == "rl"
    same = ("sft", "rl")
    assert [s for s in with_dpo["stages"] if s["name"] in same] == without["stages"]


def test_the_calculator_arms_differ_by_the_tool_alone(tmp_path):
    tool, _ = _plan(tmp_path, CALCULATOR, "tool")
    direct, _ = _plan(tmp_path, CALCULATOR, "direct")
    assert "calculator" in tool["stages"][1]["presets"]
    assert all("calculator" not in s["presets"] for s in direct["stages"])
    assert "data.path=builtin:calculator-answers" in direct["stages"][0]["overrides"]


def test_a_model_of_its_own_needs_an_engine_of_its_own_the_rl_versions_share_one():
    points = PREFERENCE.points("dpo")
    assert [[p.name for p in group] for group in engines(points)] == [
        ["base"], ["sft"], ["dpo", "rl"],
    ]  # fmt: skip
    assert [p.source for p in engines(points)[-1]] == ["rl:0", "rl:last"]  # version 0 first
    assert [[p.name for p in g] for g in engines(PREFERENCE.points("no-dpo"))] == [
        ["base"], ["sft", "rl"],
    ]  # fmt: skip
    assert engines((Point("base", "base", "base"),)) == [[Point("base", "base", "base")]]


def _cell(arm, seed, acc, pairs=None):
    evaluations = {p.name: {"val/acc_greedy": acc[p.name], "val/pass@1": acc[p.name] / 2,
                            "val/response_len_mean": 20.0}
                   for p in PREFERENCE.points(arm)}  # fmt: skip
    rl = [{"step": s, "rollout/acc": a} for s, a in enumerate((0.1, 0.3, 0.5, 0.7), 1)]
    stages = {"rl": {"steps": rl}}
    if pairs is not None:
        before, after = pairs
        stages["dpo"] = {"steps": [
            {"step": 1, **{f"initial/pref/eval_{m}": before for m in
                           ("accuracy", "likelihood_accuracy", "margin")}},
            {"step": 2, **{f"pref/eval_{m}": after for m in
                           ("accuracy", "likelihood_accuracy", "margin")}},
        ]}  # fmt: skip
    return {"arm": arm, "seed": seed, "evaluations": evaluations, "stages": stages,
            "wall_s": 600.0, "wall_comparable": seed == 0, "eval_prompts": 128, "k": 4}  # fmt: skip


def test_the_preference_tables_read_the_cells():
    cells = [
        _cell("dpo", 0, {"base": 0.1, "sft": 0.4, "dpo": 0.5, "rl": 0.6}, pairs=(0.0, 0.9)),
        _cell("dpo", 1, {"base": 0.1, "sft": 0.4, "dpo": 0.7, "rl": 0.8}, pairs=(0.0, 0.7)),
        _cell("no-dpo", 0, {"base": 0.1, "sft": 0.4, "rl": 0.5}),
    ]
    lines = PREFERENCE.report(cells)
    assert "| dpo | after DPO | 0,1 | 0.600 ± 0.141 | 0.300 ± 0.071 | 20.0 ± 0.0 |" in lines
    assert "| no-dpo | after RL | 0 | 0.500 | 0.250 | 20.0 |" in lines
    assert not any(line.startswith("| no-dpo | after DPO") for line in lines)
    assert "| before DPO (after SFT) | 0,1 | 0.000 ± 0.000 | 0.000 ± 0.000 | 0.000 ± 0.000 |" in (
        lines
    )
    assert "| after DPO | 0,1 | 0.800 ± 0.141 | 0.800 ± 0.141 | 0.800 ± 0.141 |" in lines
    assert "| dpo | 0,1 | 0.200 ± 0.000 | 0.600 ± 0.000 |" in lines  # first 2, last 2 RL steps
    assert lines[-1].endswith("dpo-s0 600 s, dpo-s1 600 s (resumed), no-dpo-s0 600 s.")
