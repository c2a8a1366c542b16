"""A run on reasoning-gym tasks: data.path and generator.reward.fn go together (both directions,
each refusal naming the fix), the tasks bring their own held-out split (data.val_path is
refused; the evaluator reads the held-out split by default), and data.source reads as
data.path."""

from __future__ import annotations

import pytest

from streamrl.config.base import ConfigError
from streamrl.config.loading import load_config
from streamrl.evaluation.evaluator import validation_dataset

TASKS = "reasoning_gym:leg_counting,chain_sum"
GYM = [f"data.path={TASKS}", "generator.reward.fn=reasoning_gym", "data.val_path=null"]
"""The size presets name a validation file: a run on reasoning-gym tasks unsets it."""


def _problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as excinfo:
        load_config(["dapo", "tiny-cpu"], overrides=list(overrides))
    return "\n".join(excinfo.value.problems)


def test_reasoning_gym_tasks_with_their_reward_load():
    config = load_config(["dapo", "tiny-cpu"], overrides=GYM)
    assert config.data.procedural
    assert config.generator.reward.fn == "reasoning_gym"
    # a user's reward function may read the tasks' ground truths its own way
    load_config(["dapo", "tiny-cpu"], overrides=[*GYM, "generator.reward.fn=my_rewards:gym"])


def test_data_source_replaces_the_presets_data_path():
    """Every size preset sets data.path: data.source on top of one names the dataset, and an
    eval.dataset inherits it as its path unless it names its own."""
    config = load_config(["dapo", "tiny-cpu"], overrides=[f"data.source={TASKS}", *GYM[1:]])
    assert config.data.path == TASKS
    own = load_config(
        ["dapo", "tiny-cpu"],
        overrides=[f"data.source={TASKS}", *GYM[1:], "eval.dataset.reasoning_gym.eval_size=5"],
    )
    assert own.eval.dataset.path == TASKS
    assert own.eval.dataset.reasoning_gym.eval_size == 5
    other = load_config(
        ["dapo", "tiny-cpu"],
        overrides=[
            f"data.source={TASKS}",
            *GYM[1:],
            "eval.dataset.path=reasoning_gym:leg_counting",
        ],
    )
    assert other.eval.dataset.path == "reasoning_gym:leg_counting"
    assert other.data.path == TASKS
    source = load_config(
        ["dapo", "tiny-cpu"], overrides=[*GYM, "eval.dataset.source=reasoning_gym:chain_sum"]
    )
    assert source.eval.dataset.path == "reasoning_gym:chain_sum"


def test_reasoning_gym_tasks_with_another_registered_reward_are_refused():
    text = _problems(*GYM, "generator.reward.fn=math")
    assert "data.path names reasoning-gym tasks" in text
    assert "generator.reward.fn is 'math'" in text
    assert "set generator.reward.fn=reasoning_gym" in text


def test_the_reasoning_gym_reward_without_its_tasks_is_refused():
    text = _problems("data.path=builtin:arithmetic", GYM[1])
    assert "generator.reward.fn=reasoning_gym scores reasoning-gym tasks" in text
    assert "data.path is 'builtin:arithmetic'" in text
    assert "set data.path=reasoning_gym:<task>,..." in text


def test_a_validation_file_beside_reasoning_gym_tasks_is_refused():
    text = _problems(*GYM[:2], "data.val_path=val.jsonl")
    assert "bring their own held-out split" in text
    assert "set data.val_path=null" in text


def test_the_evaluator_reads_the_tasks_held_out_split_by_default():
    config = load_config(["dapo", "tiny-cpu"], overrides=[*GYM, "data.reasoning_gym.seed=3"])
    dataset, held_out = validation_dataset(config)
    assert held_out
    assert dataset.path == TASKS
    assert dataset.reasoning_gym.split == "eval"
    assert dataset.reasoning_gym.seed == 3
    assert config.data.reasoning_gym.split == "train"  # the run's own section is left as it was
    training, held_out = validation_dataset(config, config.data)
    assert (training.reasoning_gym.split, held_out) == ("train", False)
