"""Agents whose code fails, through the real path short of vLLM: the user's agent function in
its environment worker, on the real `openai` client, against the generator's endpoint, driven
by `EpisodeDriver` as the generator loop drives it; the engine is scripted (it samples the
same short answer for every request).

An agent that raises the same TypeError on every run, and one whose every request is refused
(it asks for temperature 0.2), stop the driver with `UserCodeFailedError` naming the agent and
the reason — for the second, that every request was refused and why, not that it never called
the endpoint — once its runs failed alike in `generator.identical_failed_groups_to_stop`
groups; so does one that never calls the endpoint. An agent that fails one run in three goes
on. Each group's failures are one warning saying what became of them and the group."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from transformers import AutoTokenizer

from streamrl.config.loading import load_config
from streamrl.data import Prompt
from streamrl.envs.runner import EnvRunner
from streamrl.generator.engine import Completion, FinishedGroup
from streamrl.generator.failures import UserCodeFailedError
from streamrl.generator.rollouts import EpisodeDriver, Rollout
from streamrl.models import resolve_model_path

USER = {"role": "user", "content": "What is 2+3?"}
PROMPT = Prompt("p0", "What is 2+3?", [1], "5", (USER,))
LIMIT = 3  # generator.identical_failed_groups_to_stop


class _Engine:
    """Samples "5" and the end of turn for every request, at once."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.policy_version = 0
        ids = [*tokenizer.encode("5", add_special_tokens=False)]
        self.ids = np.asarray([*ids, tokenizer.convert_tokens_to_ids("<|im_end|>")], np.int32)
        self.requests: dict[str, list[int]] = {}
        self.submitted = 0

    @property
    def num_in_flight(self) -> int:
        return len(self.requests)

    def submit(self, prompt_token_ids: list[int], **_: Any) -> str:
        self.submitted += 1
        self.requests[f"r{self.submitted}"] = list(prompt_token_ids)
        return f"r{self.submitted}"

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def step(self) -> list[FinishedGroup]:
        n = len(self.ids)
        completion = Completion(self.ids, np.full(n, -0.5, np.float32), "5", "stop",
                                np.zeros(n, np.int64))  # fmt: skip
        finished = [
            FinishedGroup(r, p, [completion], 0, time.time()) for r, p in self.requests.items()
        ]
        self.requests.clear()
        return finished


@contextlib.contextmanager
def _driver(agent: str) -> Iterator[tuple[EpisodeDriver, _Engine]]:
    config = load_config(["grpo", "tiny-cpu"], overrides=[
        f"generator.env.agent=tests.agent_fns:{agent}", "generator.group_size=2",
        f"generator.identical_failed_groups_to_stop={LIMIT}", "generator.env.workers=1",
        "generator.env.episode_timeout_s=60", "generator.reward.workers=1",
    ])  # fmt: skip
    engine = _Engine(AutoTokenizer.from_pretrained(resolve_model_path("tiny-qwen2")))
    template = engine.tokenizer.chat_template
    with EnvRunner.from_config(config.generator.env, config.generator.reward, template) as runner:
        driver = EpisodeDriver(config, engine, runner)  # type: ignore[arg-type]
        try:
            yield driver, engine
        finally:
            driver.close()


def _groups(driver: EpisodeDriver, engine: _Engine, count: int) -> list[Rollout]:
    """Run `count` groups, two at a time, until each is scored or dropped."""
    started, scored = 0, []
    deadline = time.monotonic() + 120
    while len(scored) + len(driver.dropped) < count:
        assert time.monotonic() < deadline, "the groups did not end"
        while started < count and driver.groups_in_flight < 2:
            driver.start(PROMPT, f"g{started}")
            started += 1
        finished = engine.step() if engine.num_in_flight else []
        scored += driver.advance(finished)
        time.sleep(0.005)
    return scored


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_an_agent_raising_on_every_run_stops_it_naming_the_error(caplog) -> None:
    caplog.set_level(logging.WARNING, "streamrl")
    with (
        _driver("raises_type_error") as (driver, engine),
        pytest.raises(UserCodeFailedError) as stopped,
    ):
        _groups(driver, engine, 10 * LIMIT)
    message = str(stopped.value)
    assert message.startswith(
        "agent 'tests.agent_fns:raises_type_error' (generator.env.agent) failed the same way "
        f"every time it ran in its first {LIMIT} groups ({2 * LIMIT} times), and never "
        "succeeded: it raised TypeError:"
    )
    assert "int() argument must be" in message
    dropped = [w for w in _warnings(caplog) if "sampled a turn" in w]
    assert len(dropped) == LIMIT  # one per group, saying what happened to it; none later
    assert dropped[0].startswith(
        "agent 'tests.agent_fns:raises_type_error': no run on prompt p0 sampled a turn, so its "
        "group is dropped (2× env_error: it raised TypeError:"
    )
    assert not any("scores 0" in w for w in _warnings(caplog))


def test_an_agent_whose_every_request_is_refused_stops_it_naming_the_refusal(caplog) -> None:
    caplog.set_level(logging.WARNING, "streamrl")
    with (
        _driver("other_temperature") as (driver, engine),
        pytest.raises(UserCodeFailedError) as stopped,
    ):
        _groups(driver, engine, 10 * LIMIT)
    message = str(stopped.value)
    assert "agent 'tests.agent_fns:other_temperature'" in message
    assert "never succeeded: every request it sent was refused (400: temperature=0.2: this run " \
        "samples at generator.temperature=1" in message  # fmt: skip
    assert "without calling" not in message
    assert engine.submitted == 0  # refused before anything was sampled


def test_an_agent_that_never_calls_the_endpoint_stops_it_saying_so() -> None:
    with (
        _driver("never_calls") as (driver, engine),
        pytest.raises(UserCodeFailedError) as stopped,
    ):
        _groups(driver, engine, 10 * LIMIT)
    assert str(stopped.value).startswith("agent 'tests.agent_fns:never_calls'")
    assert "never succeeded: it returned without calling the endpoint." in str(stopped.value)


def test_an_agent_failing_one_run_in_three_goes_on_and_says_which_runs_are_left_out(caplog) -> None:
    caplog.set_level(logging.WARNING, "streamrl")
    with _driver("fails_one_in_three") as (driver, engine):
        scored = _groups(driver, engine, 6 * LIMIT)
        errors = driver.runner.stats.errors
    assert len(scored) == 6 * LIMIT, "no group lost a run it sampled"  # one in three: never both
    assert errors > 2 * LIMIT  # more failed runs, alike, than the limit needs: no stop
    left_out = [w for w in _warnings(caplog) if "left out of the group" in w]
    assert len(left_out) == errors
    assert left_out[0].startswith(
        "agent 'tests.agent_fns:fails_one_in_three', prompt p0: 1 of its runs sampled nothing "
        "and are left out of the group (env_error: it raised TypeError:"
    )
