"""A recipe's `models_dir` must lie apart from its root and its stages' folders
(`streamrl.recipes.folders`), refused when the recipe is planned, before any stage runs: with
`models_dir` = the root, a stage's model would be exported over that stage's own run. Local
paths are compared resolved (relative, `./`, trailing `/`, symlinks); s3:// URIs by segments."""

from __future__ import annotations

import re

import pytest
import yaml

from streamrl.config.base import ConfigError
from streamrl.recipes import load_recipe, plan_recipe

STAGES = [
    {"name": "warm", "presets": ["tiny-cpu", "sft"], "overrides": ["data.path=conv.jsonl"]},
    {"name": "rl", "presets": ["dapo", "tiny-cpu"]},
    {"name": "model", "kind": "export", "of": "rl"},
]


@pytest.fixture
def recipe(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump({"stages": STAGES}))
    return load_recipe(str(path))


def _refused(recipe, root: str, models_dir: str) -> str:
    with pytest.raises(ConfigError) as refused:
        plan_recipe(*recipe, root, models_dir=models_dir)
    assert len(refused.value.problems) == 1, refused.value.problems
    return refused.value.problems[0]


def test_models_dir_at_the_root_is_refused_naming_both_and_the_fix(tmp_path, recipe) -> None:
    root = str(tmp_path / "root")
    for same in (root, f"{root}/", f"{tmp_path}/./root", f"{tmp_path}/other/../root"):
        problem = _refused(recipe, root, same)
        assert problem.startswith(f"models_dir {same} is the recipe's root {root}")
        assert "give models_dir a folder of its own" in problem
        assert f"{root}/models" in problem  # the default, as the fix
    assert not (tmp_path / "root").exists()  # refused before anything was written


def test_a_relative_root_and_an_absolute_models_dir_are_compared_resolved(
    tmp_path, recipe, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert "is the recipe's root" in _refused(recipe, "./runs/x", str(tmp_path / "runs" / "x"))


def test_a_models_dir_linked_to_the_root_is_refused(tmp_path, recipe) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "link").symlink_to(root)
    assert "is the recipe's root" in _refused(recipe, str(root), str(tmp_path / "link"))
    # and a root reached through a link, with models_dir inside a stage's real folder
    (root / "rl").mkdir()
    problem = _refused(recipe, str(tmp_path / "link"), str(root / "rl" / "models"))
    assert "lies inside stage rl's folder" in problem


@pytest.mark.parametrize(
    ("inside", "problem"),
    [
        ("warm", "is stage warm's folder {root}/warm"),
        ("rl/models", "lies inside stage rl's folder {root}/rl"),
        ("model", "is stage model's folder {root}/model"),  # the export stage's model
    ],
)
def test_models_dir_in_a_stage_folder_is_refused(tmp_path, recipe, inside, problem) -> None:
    root = str(tmp_path / "root")
    got = _refused(recipe, root, f"{root}/{inside}")
    assert got.startswith(f"models_dir {root}/{inside} ")
    assert problem.format(root=root) in got


def test_models_dir_above_the_root_is_refused(tmp_path, recipe) -> None:
    root = str(tmp_path / "recipes" / "root")
    problem = _refused(recipe, root, str(tmp_path))
    assert problem.startswith(f"models_dir {tmp_path} contains the recipe's root {root}")


def test_folders_apart_are_accepted(tmp_path, recipe) -> None:
    root = str(tmp_path / "root")
    assert plan_recipe(*recipe, root).models_dir == f"{root}/models"  # the default
    for apart in (f"{root}-models", f"{root}/models/v2", str(tmp_path / "models")):
        plan = plan_recipe(*recipe, root, models_dir=apart)
        assert plan.stage("warm").export_to == f"{apart}/warm"


@pytest.mark.parametrize(
    ("models_dir", "problem"),
    [
        ("s3://bucket/recipes/x", "is the recipe's root s3://bucket/recipes/x"),
        ("s3a://bucket//recipes/x/", "is the recipe's root s3://bucket/recipes/x"),
        ("s3://bucket/recipes", "contains the recipe's root s3://bucket/recipes/x"),
        ("s3://bucket/recipes/x/rl/m", "lies inside stage rl's folder s3://bucket/recipes/x/rl"),
        ("s3://bucket/recipes/x/warm", "is stage warm's folder s3://bucket/recipes/x/warm"),
    ],
)
def test_s3_folders_are_compared_by_segments(recipe, models_dir, problem) -> None:
    assert problem in _refused(recipe, "s3://bucket/recipes/x/", models_dir)


def test_s3_folders_apart_and_a_local_models_dir_are_accepted(tmp_path, recipe) -> None:
    root = "s3://bucket/recipes/x"
    for apart in ("s3://bucket/recipes/x-2", "s3://other/recipes/x", str(tmp_path / "m")):
        plan_recipe(*recipe, root, models_dir=apart)
    with pytest.raises(ConfigError, match=re.escape("give models_dir (a local folder)")):
        plan_recipe(*recipe, root)
