"""Which failures of the user's code stop a generator as a restart would fail alike
(`streamrl.generator.failures`): the same failure in every call of the first groups does, at
exactly the limit; a failure that comes and goes, or reasons that differ, never do; each piece
of code is judged on its own; timeouts count for nothing; an agent whose runs sample nothing for
many groups stops it whatever the reasons, naming them."""

from __future__ import annotations

import pytest

from streamrl.config.loading import load_config
from streamrl.envs.base import Task
from streamrl.envs.runner import Episode, Scored
from streamrl.generator.agent_episodes import RunEnd
from streamrl.generator.failures import (
    MAX_UNSAMPLED_GROUPS_IN_A_ROW,
    AgentSamplesNothingError,
    IdenticalFailures,
    UserCodeFailedError,
    UserCodeWatch,
)

AGENT = "agent 'pkg.agents:solve' (generator.env.agent)"
TYPE_ERROR = "it raised TypeError: unsupported operand | agents.py, line 3"
LIMIT = "generator.identical_failed_groups_to_stop=2"


def test_the_same_failure_from_the_start_stops_at_the_limit_naming_code_and_reason() -> None:
    failures = IdenticalFailures(limit=4)
    for _ in range(3):
        failures.failed(AGENT, TYPE_ERROR, times=8)
    with pytest.raises(UserCodeFailedError) as stopped:
        failures.failed(AGENT, TYPE_ERROR, times=8)
    message = str(stopped.value)
    assert message.startswith(
        f"{AGENT} failed the same way every time it ran in its first 4 groups (32 times)"
    )
    assert TYPE_ERROR in message
    assert "generator.identical_failed_groups_to_stop" in message


def test_one_success_turns_the_check_off_for_that_code_for_good() -> None:
    failures = IdenticalFailures(limit=4)
    failures.failed(AGENT, TYPE_ERROR)
    failures.ok(AGENT)
    for _ in range(1000):  # fails ever after: it has worked, a restart may not fail alike
        failures.failed(AGENT, TYPE_ERROR)


def test_failures_that_differ_never_stop_it_but_a_new_run_of_one_reason_does() -> None:
    failures = IdenticalFailures(limit=3)
    for i in range(100):
        failures.failed(AGENT, f"it raised KeyError: {i % 2}")
        if i % 7 == 0:
            failures.differed(AGENT)
    failures.failed(AGENT, TYPE_ERROR)
    failures.differed(AGENT)  # a group whose failures had several reasons breaks the run
    failures.failed(AGENT, TYPE_ERROR)
    failures.failed(AGENT, TYPE_ERROR)
    with pytest.raises(UserCodeFailedError, match="in its first 3 groups"):
        failures.failed(AGENT, TYPE_ERROR)


def test_each_code_is_judged_on_its_own() -> None:
    failures = IdenticalFailures(limit=2)
    failures.ok("reward 'math' (generator.reward.fn)")  # the reward works; the agent does not
    failures.failed(AGENT, TYPE_ERROR)
    with pytest.raises(UserCodeFailedError, match=r"agent 'pkg\.agents:solve'"):
        failures.failed(AGENT, TYPE_ERROR)


def _watch(*overrides: str) -> UserCodeWatch:
    config = load_config(["grpo", "tiny-cpu"], overrides=[LIMIT, *overrides])
    return UserCodeWatch(config.generator)


def test_a_group_of_agent_runs_counts_once_and_one_run_through_is_a_success() -> None:
    refused = "every request it sent was refused (400: temperature=0.2: ...)"
    watch = _watch("generator.env.agent=pkg.agents:solve")
    watch.agent_group([RunEnd("env_error", refused, False), RunEnd("done", "", True)])
    for _ in range(10):
        watch.agent_group([RunEnd("env_error", refused, False)] * 8)
    watch = _watch("generator.env.agent=pkg.agents:solve")
    watch.agent_group([RunEnd("env_error", refused, False)] * 8)  # one group: not yet
    timeouts = [RunEnd("timeout", "it exceeded 5s", True), RunEnd("timeout", "", False)]
    watch.agent_group(timeouts)  # timeouts alone: neither success nor failure
    with pytest.raises(UserCodeFailedError, match=r"\(9 times\), .*refused \(400: temp"):
        watch.agent_group([RunEnd("no_request", refused, False), *timeouts])


def test_agents_that_sample_nothing_stop_it_after_many_groups_naming_why() -> None:
    watch = _watch("generator.env.agent=pkg.agents:solve")  # failures differ within each group
    never = RunEnd("no_request", "it returned without calling the endpoint", False)
    for i in range(MAX_UNSAMPLED_GROUPS_IN_A_ROW - 1):
        watch.agent_group([never, RunEnd("env_error", f"it raised KeyError: {i}", False)])
    watch.agent_group([never, RunEnd("done", "", True)])  # a group that sampled: from zero
    for i in range(MAX_UNSAMPLED_GROUPS_IN_A_ROW - 1):
        watch.agent_group([never, RunEnd("env_error", f"it raised KeyError: {i}", False)])
    with pytest.raises(AgentSamplesNothingError) as stopped:
        watch.agent_group([never])
    assert isinstance(stopped.value, UserCodeFailedError)  # exit code 4: not restarted
    message = str(stopped.value)
    assert f"in the last {MAX_UNSAMPLED_GROUPS_IN_A_ROW} groups" in message
    assert f"({MAX_UNSAMPLED_GROUPS_IN_A_ROW}× it returned without calling the endpoint;" in message


def test_an_environments_episodes_and_its_scores_are_told_apart() -> None:
    env = "generator.env.fn=tests.env_fns:KeepTalking"
    task = Task([{"role": "user", "content": "go"}], "5")
    done = Episode(task, finish_reason="done")
    failed = Episode(task, finish_reason="env_error", error="it raised ValueError: step")
    scored = Scored(1.0, (), "done")
    unscored = Scored(0.0, (), "env_error", "error", failed.error)  # no score call was made
    watch = _watch(env)
    watch.scored([failed] * 4, [unscored] * 4)
    with pytest.raises(UserCodeFailedError) as stopped:
        watch.reset_failed(failed)  # a reset is the environment's code too
    assert str(stopped.value).startswith("environment 'tests.env_fns:KeepTalking'")
    assert "(5 times), and never succeeded: it raised ValueError: step" in str(stopped.value)
    intermittent = _watch(env)
    intermittent.scored([done, failed], [scored, unscored])
    for _ in range(5):
        intermittent.scored([failed] * 4, [unscored] * 4)
    broken = Scored(0.0, (), "done", "error", "it raised ZeroDivisionError: x")
    watch = _watch(env)
    watch.scored([done, done], [broken, broken])
    with pytest.raises(UserCodeFailedError, match="the score of environment"):
        watch.scored([done, done], [broken, broken])


def test_a_service_down_for_now_never_stops_the_generator():
    """A reward whose service is unreachable at the start fails alike in every group; the code
    is fine, the service may answer next time: no stop however many groups."""
    from streamrl.generator.failures import IdenticalFailures

    watch = IdenticalFailures(limit=2)
    for reason in ["it raised ConnectionError: [Errno 111] Connection refused",
                   "it raised httpx.ConnectTimeout: timed out",
                   "it raised OSError: [Errno 113] No route to host"]:  # fmt: skip
        for _ in range(5):
            watch.failed("reward 'pkg:score' (generator.reward.fn)", reason, times=8)
