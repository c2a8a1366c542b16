"""Recipes are checked whole before anything starts (`streamrl.recipes.plan_recipe`): a bad field
in a later stage is refused naming that stage, references name earlier run stages, and each run
stage starts from the model the stage before it exports."""

from __future__ import annotations

import re

import pytest
import yaml

from streamrl.config.base import ConfigError
from streamrl.recipes import available_recipes, load_recipe, plan_recipe


def _recipe(tmp_path, stages, name="mine"):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"stages": stages, "overrides": ["learner.total_steps=6"]}))
    return load_recipe(str(path))


SFT = {"name": "warm", "presets": ["tiny-cpu", "sft"], "overrides": ["data.path=conv.jsonl"]}
RL = {"name": "rl", "presets": ["dapo", "tiny-cpu"]}


def test_a_recipe_chains_its_runs_through_exported_models(tmp_path) -> None:
    name, recipe = _recipe(tmp_path, [SFT, RL, {"name": "score", "kind": "eval", "of": "rl"},
                                      {"name": "model", "kind": "export", "of": "rl"}])  # fmt: skip
    plan = plan_recipe(name, recipe, str(tmp_path / "root"), overrides=["learner.lr=3e-6"])
    warm, rl, score, model = plan.stages
    assert warm.config.sft is not None
    assert rl.config.sft is None
    assert (warm.start_from, rl.start_from) == (None, "warm")
    assert rl.config.model.path == f"{tmp_path}/root/models/warm" == warm.export_to
    assert rl.config.storage.run_uri == f"{tmp_path}/root/rl"
    assert (rl.config.learner.total_steps, rl.config.learner.lr) == (6, 3e-6)  # recipe, flow
    assert (score.uri, model.uri) == (f"{tmp_path}/root/score", f"{tmp_path}/root/model")
    assert not any(step.done() or step.started() for step in plan.stages)
    assert not (tmp_path / "root").exists()  # planning writes nothing


def test_a_bad_field_in_a_later_stage_is_refused_naming_it_before_anything_runs(tmp_path):
    bad = {**RL, "overrides": ["learner.lr=-1"]}
    name, recipe = _recipe(tmp_path, [SFT, {**RL, "name": "rl1"}, {**bad, "name": "rl2"}])
    with pytest.raises(ConfigError) as refused:
        plan_recipe(name, recipe, str(tmp_path / "root"))
    assert len(refused.value.problems) == 1
    assert refused.value.problems[0].startswith("stage 3 (rl2): learner.lr")
    assert not (tmp_path / "root").exists()


@pytest.mark.parametrize(
    ("stages", "problem"),
    [
        (
            [{"name": "e", "kind": "eval", "of": "rl"}, RL],
            "stage 1 (e): of='rl' is not a run stage",
        ),
        ([RL, {**RL, "start_from": "later"}], "start_from='later' is not a run stage before it"),
        ([RL, RL], "stage 2 (rl): another stage is named 'rl'"),
        ([{**RL, "name": "Big Stage"}], "a stage's name is lower case letters"),
        ([{**RL, "name": "models"}], "a stage's name is lower case letters"),
    ],
)
def test_stage_references_and_names_are_checked(tmp_path, stages, problem) -> None:
    name, recipe = _recipe(tmp_path, stages)
    with pytest.raises(ConfigError, match=re.escape(problem)):
        plan_recipe(name, recipe, str(tmp_path / "root"))


def test_a_recipe_that_cannot_be_read_is_refused_naming_the_fix(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"no recipe 'nope'.*calculator-agent"):
        load_recipe("nope")
    with pytest.raises(ConfigError, match=r"stages\.0\.run\.presets"):
        _recipe(tmp_path, [{"name": "x"}])
    with pytest.raises(ConfigError, match=r"stages\.0\.export\.of"):
        _recipe(tmp_path, [{"name": "x", "kind": "export"}])
    name, recipe = _recipe(tmp_path, [RL])
    with pytest.raises(ConfigError, match="give models_dir"):
        plan_recipe(name, recipe, "s3://bucket/recipes/x")


def test_the_bundled_recipes_plan() -> None:
    assert "calculator-agent" in available_recipes()
    name, recipe = load_recipe("calculator-agent")
    plan = plan_recipe(name, recipe, "./runs/agent")
    sft, rl = plan.stages[:2]
    assert sft.config.sft.tools == "environment"
    assert sft.config.generator.env.fn == rl.config.generator.env.fn == "calculator"
    assert rl.start_from == "sft"


def test_an_evaluation_reads_as_one_line_with_what_the_agent_did() -> None:
    from flows.recipe import eval_line

    single = {"version": 3, "val/acc_greedy": 0.5, "val/avg@4": 0.375, "val/pass@1": 0.375,
              "val/pass@4": 0.75, "val/num_prompts": 64.0}  # fmt: skip
    assert eval_line(single) == "greedy 0.500, pass@1 0.375, pass@4 0.750 over 64 prompts"
    agent = {**single, "val/tool_use_frac": 0.96875, "val/tool_calls_mean": 1.125,
             "val/tool_errors_mean": 0.0625}  # fmt: skip
    assert eval_line(agent).endswith(
        "over 64 prompts; the tool called in 96.9% of episodes, 1.12 calls and 0.06 failed per "
        "episode"
    )


def test_the_sft_dpo_rl_recipe_plans_three_learning_stages() -> None:
    name, recipe = load_recipe("sft-dpo-rl")
    plan = plan_recipe(name, recipe, "./runs/sft-dpo-rl")
    sft, dpo, rl = plan.stages[:3]
    assert sft.config.learner_only == "supervised"
    assert dpo.config.learner_only == "preference"
    assert dpo.config.preference.loss == "dpo"
    assert rl.config.learner_only is None
    assert (dpo.start_from, rl.start_from) == ("sft", "dpo")
    assert dpo.config.data.path == "builtin:arithmetic-pairs"


def test_a_stages_kind_says_whether_it_trains_pairs(tmp_path) -> None:
    """`kind: preference` is the one way to write a preference stage: one whose presets do not
    set the preference section is refused naming the presets, and a `run` stage whose presets
    set it is refused naming the kind."""
    pairs = ["data.path=pairs.jsonl"]
    dpo = {"name": "dpo", "kind": "preference", "presets": ["tiny-cpu", "dpo"], "overrides": pairs}
    name, recipe = _recipe(tmp_path, [SFT, dpo, RL])
    _, pref, rl = plan_recipe(name, recipe, str(tmp_path / "root")).stages
    assert (pref.start_from, pref.config.learner_only) == ("warm", "preference")
    assert (rl.start_from, rl.config.learner_only) == ("dpo", None)

    unset = {**dpo, "presets": ["tiny-cpu"]}
    as_run = {**dpo, "kind": "run"}
    name, recipe = _recipe(tmp_path, [unset, as_run | {"name": "dpo2"}])
    with pytest.raises(ConfigError) as error:
        plan_recipe(name, recipe, str(tmp_path / "root"))
    problems = error.value.problems
    assert any(p.startswith("stage 1 (dpo)") and "add one of the presets dpo, ipo, simpo" in p
               for p in problems), problems  # fmt: skip
    assert any(p.startswith("stage 2 (dpo2)") and "make it `kind: preference`" in p
               for p in problems), problems  # fmt: skip
