"""The `code_feedback` environment (`streamrl.envs.code_feedback`): programs run on the public
tests in the box, failures answered with what was expected and what happened, the episode over
at the first full pass, the final program scored on every test, hidden ones included."""

from __future__ import annotations

import json

import pytest

from streamrl.envs.base import EnvContext, Task
from streamrl.envs.code_feedback import NO_PROGRAM, CodeFeedbackEnv
from streamrl.envs.formats import TOOL_FORMATS
from streamrl.envs.worker import checked_reset, checked_step
from streamrl.rewards.code.config import CodeRewardConfig
from streamrl.rewards.code.reward import CodeReward
from streamrl.rewards.math import math_reward

# Public: times_k(3) == 21; hidden: two more, which only a right program passes.
TRUTH = json.dumps({
    "public_test_cases": [{"input": "3", "output": "21", "testtype": "functional"},
                          {"input": "0", "output": "0", "testtype": "functional"}],
    "private_test_cases": [{"input": "-2", "output": "-14", "testtype": "functional"}],
    "metadata": {"func_name": "times_k"},
})  # fmt: skip
TASK = Task([{"role": "user", "content": "Write times_k(x): x times 7."}], TRUTH)


def env(max_chars: int = 4000) -> CodeFeedbackEnv:
    reward = CodeReward(CodeRewardConfig(test_timeout_s=2.0), call_limit_s=30.0)
    context = EnvContext(reward, "code", TOOL_FORMATS["hermes"], observation_max_chars=max_chars)
    return CodeFeedbackEnv(context)


def program(body: str) -> str:
    return f"```python\ndef times_k(x):\n    return {body}\n```"


def test_a_failing_program_gets_the_failed_public_tests_back() -> None:
    agent = env()
    reset = checked_reset(agent, TASK)
    step = checked_step(agent, TASK, reset.state, program("x * 6"))
    assert not step.done
    assert step.reward == pytest.approx(0.5)  # times_k(0) == 0 passes, times_k(3) does not
    feedback = step.messages[0]["content"]
    assert "passed 1 of 2 tests" in feedback
    assert "times_k(3) should return 21: wrong (returned 18)" in feedback
    assert "times_k(-2)" not in feedback  # hidden tests are never shown
    assert step.state == {"turns": 1, "passed": [0.5]}


def test_the_first_full_pass_ends_the_episode_and_scores_every_test() -> None:
    agent = env()
    state = checked_reset(agent, TASK).state
    first = checked_step(agent, TASK, state, program("x * 6"))
    second = checked_step(agent, TASK, first.state, program("x * 7"))
    assert (second.done, second.reward, second.state["passed"]) == (True, 1.0, [0.5, 1.0])
    assert agent.score(TASK, second.state, program("x * 7")) == 1.0
    # Public tests alone can be gamed; the hidden one cannot.
    gamed = program("{3: 21, 0: 0}.get(x, 0)")
    assert checked_step(agent, TASK, state, gamed).done
    assert agent.score(TASK, state, gamed) == 0.0


def test_a_turn_without_a_program_is_told_so() -> None:
    agent = env()
    step = checked_step(agent, TASK, checked_reset(agent, TASK).state, "x times 7 is the answer")
    assert step.messages[0]["content"] == NO_PROGRAM
    assert step.reward == 0.0


def test_feedback_stays_within_the_observation_budget() -> None:
    agent = env(max_chars=120)
    step = checked_step(agent, TASK, checked_reset(agent, TASK).state, program("'x' * 10**4"))
    assert len(step.messages[0]["content"]) <= 120


def test_it_needs_the_code_reward() -> None:
    with pytest.raises(ValueError, match=r"set generator\.reward\.fn: code"):
        CodeFeedbackEnv(EnvContext(math_reward, "math", TOOL_FORMATS["hermes"]))
