"""The `code` reward and the `code_feedback` agent configured as a run configures them and run
where a generator runs them: in spawned worker processes that load a `RewardSpec`
(`generator.reward.code` reaches them), their programs in the box."""

from __future__ import annotations

import json

from streamrl.config.loading import load_config
from streamrl.envs.base import Task
from streamrl.envs.runner import EnvRunner
from streamrl.rewards.scoring import RewardScorer

TRUTH = json.dumps({
    "public_test_cases": [{"input": "2", "output": "4", "testtype": "functional"}],
    "private_test_cases": [{"input": "5", "output": "10", "testtype": "functional"},
                           {"input": "-1", "output": "-2", "testtype": "functional"}],
    "metadata": {"func_name": "double"},
})  # fmt: skip
RIGHT = "```python\ndef double(x):\n    return 2 * x\n```"
HALF = "```python\ndef double(x):\n    return 4 if x == 2 else 10\n```"  # 2 of 3 tests


def test_the_scorer_workers_get_the_code_settings_of_the_config() -> None:
    for score, expected in (("all", 0.0), ("fraction", 2 / 3)):
        config = load_config(
            ["dapo", "tiny-cpu", "code"],
            overrides=[f"generator.reward.code.score={score}", "generator.reward.workers=1"],
        )
        with RewardScorer.from_config(config.generator.reward) as scorer:
            scores = scorer.score([RIGHT, HALF, "no code"], [TRUTH] * 3)
        assert scores.failures == [None, None, None]
        assert scores.values == [1.0, expected, 0.0]


def test_the_code_agent_runs_in_environment_workers() -> None:
    config = load_config(
        ["dapo", "tiny-cpu", "code", "code_feedback"],
        overrides=["generator.env.workers=1", "generator.reward.workers=1"],
    )
    task = Task([{"role": "user", "content": "Write double(x)."}], TRUTH)
    with EnvRunner.from_config(config.generator.env, config.generator.reward, None) as runner:
        started = runner.reset(task).result()
        wrong = runner.step(started.episode, "```python\ndef double(x):\n    return x\n```")
        feedback = wrong.result()
        assert not feedback.episode.done
        assert "double(2) should return 4: wrong (returned 2)" in feedback.messages[0]["content"]
        fixed = runner.step(feedback.episode, HALF).result()  # passes the public test: done
        assert fixed.episode.done
        assert fixed.episode.turn_rewards == (0.0, 1.0)
        scored = runner.score(fixed.episode).result()
    assert (scored.reward, scored.failure) == (0.0, None)  # the hidden tests catch it
