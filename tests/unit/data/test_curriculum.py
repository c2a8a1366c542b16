"""The reasoning-gym curriculum: a task's level rises when its rolling accuracy passes the
threshold, prompts are drawn again at the level (and scored there), old levels' groups do not
count, and a generator's levels survive a restart in its progress record."""

from __future__ import annotations

import json

import numpy as np
import pytest

from storage.control.progress import GeneratorProgress
from storage.stream.scored_group import ScoredGroup
from streamrl.data import PromptSource
from streamrl.data.config import DataConfig
from streamrl.data.curriculum import Curriculum, max_level
from streamrl.data.reasoning_gym import level_settings
from streamrl.rewards.reasoning_gym import reasoning_gym_reward

pytest.importorskip("reasoning_gym")


def _source() -> PromptSource:
    config = DataConfig.model_validate(
        {
            "path": "reasoning_gym:leg_counting,letter_counting",
            "val_path": None,
            "reasoning_gym": {"size": 40, "curriculum": {"threshold": 0.75, "window": 8}},
        }
    )
    return PromptSource(config, "smollm2-135m-instruct")


def _group(task: str, level: int, correct: list[bool]) -> ScoredGroup:
    g = len(correct)
    return ScoredGroup(
        prompt_id="p", prompt_tokens=np.array([1], np.int32), ground_truth="",
        response_tokens=[np.array([2], np.int32)] * g,
        behaviour_logprobs=[np.array([-0.1], np.float32)] * g,
        rewards=np.array(correct, np.float32), raw_scores=np.array(correct, np.float32),
        truncated=np.zeros(g, bool), finish_reasons=["stop"] * g, policy_version=0,
        generator_id="gen0", created_at=0.0, finished_at=0.0, task=task, task_level=level,
    ).validate()  # fmt: skip


def test_rows_start_at_the_curriculums_level_zero():
    source = _source()
    leg = next(p for p in source.prompts if p.task == "leg_counting")
    truth = json.loads(leg.ground_truth)
    expected = level_settings("leg_counting", {}, 0)
    assert {k: truth["config"][k] for k in expected} == expected
    assert leg.task_level == 0


def test_a_task_rises_when_its_window_passes_the_threshold_and_prompts_follow():
    source = _source()
    curriculum = Curriculum(source, source.config.reasoning_gym)
    leg = next(p for p in source.prompts if p.task == "leg_counting")
    assert curriculum.prompt(leg) is leg  # level 0: the dataset's own prompt

    curriculum.observe(_group("leg_counting", 0, [True, True, True, False]))
    assert curriculum.levels["leg_counting"] == 0  # the window is not full yet
    curriculum.observe(_group("leg_counting", 0, [True, True, True, True]))
    assert curriculum.levels == {"leg_counting": 1, "letter_counting": 0}  # 7/8 ≥ 0.75

    harder = curriculum.prompt(leg)
    assert harder.task == "leg_counting"
    assert harder.task_level == 1
    assert harder.prompt_id == f"{leg.prompt_id}@1"
    truth = json.loads(harder.ground_truth)
    assert truth["index"] == json.loads(leg.ground_truth)["index"]
    assert truth["config"]["max_animals"] == level_settings("leg_counting", {}, 1)["max_animals"]
    # the reward rebuilds the level's problem from the ground truth: its answer scores 1
    assert reasoning_gym_reward(f"<answer>{truth['expected']}</answer>", harder.ground_truth) == 1


def test_groups_of_an_earlier_level_or_below_the_threshold_do_not_raise_it():
    source = _source()
    curriculum = Curriculum(source, source.config.reasoning_gym, {"letter_counting": 2})
    for _ in range(4):  # in flight when the level rose: not counted
        curriculum.observe(_group("letter_counting", 1, [True] * 4))
    assert curriculum.levels["letter_counting"] == 2
    for _ in range(4):
        curriculum.observe(_group("letter_counting", 2, [True, False, True, False]))
    assert curriculum.levels["letter_counting"] == 2  # 0.5 < 0.75


def test_levels_stop_at_the_curriculums_highest_and_restore_from_progress():
    source = _source()
    top = max_level("leg_counting")
    curriculum = Curriculum(source, source.config.reasoning_gym, {"leg_counting": top + 5})
    assert curriculum.levels["leg_counting"] == top
    for _ in range(4):
        curriculum.observe(_group("leg_counting", top, [True] * 4))
    assert curriculum.levels["leg_counting"] == top

    record = GeneratorProgress("gen0", task_levels={"leg_counting": 3})
    again = GeneratorProgress.from_json(record.to_json())
    assert again.task_levels == {"leg_counting": 3}
    assert GeneratorProgress.from_json(b'{"writer_id": "gen0"}').task_levels == {}
    with pytest.raises(ValueError, match="task_levels"):
        GeneratorProgress("gen0", task_levels={"leg_counting": -1})
    with pytest.raises(ValueError, match="task_levels"):
        GeneratorProgress("gen0", task_levels={"leg_counting": True})


def test_a_task_without_a_curriculum_is_refused_naming_the_setting():
    from streamrl.data.rows import DatasetError

    with pytest.raises(DatasetError, match="no curriculum"):
        level_settings("not_a_curriculum_task_xyz", {}, 0)
