"""A verifiers environment's own dataset as the run's prompts (`data.path: verifiers:<split>`),
read by the real runner in the real worker environment, and its rows' answers and infos handed
back to the rollouts."""

from __future__ import annotations

import json

import pytest

from streamrl.data import PromptSource
from streamrl.data.config import DataConfig
from streamrl.data.rows import DatasetError
from streamrl.envs.config import EnvConfig
from streamrl.envs.verifiers_data import environment_rows
from streamrl.envs.verifiers_env import example_answer
from tests.unit.envs.test_verifiers_env import worker_env  # noqa: F401 (the session fixture)


def _env(worker_env, env_id: str) -> EnvConfig:  # noqa: F811
    return EnvConfig.model_validate(
        {"verifiers": {"env_id": env_id, "worker_env": str(worker_env)}, "workers": 1}
    )


def test_the_environments_dataset_becomes_rows_with_answers_and_tasks(worker_env):  # noqa: F811
    env = _env(worker_env, "vf_single_turn")
    rows = environment_rows("verifiers:train", env)
    assert rows is not None
    assert [r["prompt"][-1]["content"] for r in rows] == ["What is 2+2?", "What is 3*5?"]
    assert [example_answer(r["reward_model"]["ground_truth"]) for r in rows] == [
        ("4", {}),
        ("15", {}),
    ]
    assert {r["data_source"] for r in rows} == {"default"} or {r["data_source"] for r in rows} == {
        "vf_single_turn"
    }
    held_out = environment_rows("verifiers:eval", env)
    assert held_out is not None
    assert len(held_out) == 2

    source = PromptSource(DataConfig(path="verifiers:train"), "smollm2-135m-instruct", rows=rows)
    assert [p.ground_truth for p in source.prompts] == [
        r["reward_model"]["ground_truth"] for r in rows
    ]
    assert source.prompts[0].task is not None


def test_an_environment_without_an_eval_split_is_refused_for_evaluation(worker_env):  # noqa: F811
    env = _env(worker_env, "vf_multi_turn")
    assert environment_rows("verifiers:train", env)
    with pytest.raises(DatasetError, match="no eval split"):
        environment_rows("verifiers:eval", env)


def test_paths_that_name_no_split_or_no_environment_are_refused():
    assert environment_rows("builtin:arithmetic", EnvConfig()) is None
    with pytest.raises(DatasetError, match=r"generator\.env\.verifiers, which is unset"):
        environment_rows("verifiers:train", EnvConfig())
    with pytest.raises(DatasetError, match=r"verifiers:train .*or verifiers:eval"):
        environment_rows("verifiers:test", EnvConfig())


def test_a_rows_answer_and_info_go_back_to_the_rollout_and_other_truths_stay_whole():
    truth = json.dumps({"answer": "42", "info": {"level": 3}})
    assert example_answer(truth) == ("42", {"level": 3})
    for other in ("42", '{"answer": 42}', '{"answer": "4", "info": {}, "x": 1}', "{not json"):
        assert example_answer(other) == (other, {})
