"""Tests for running environments in isolated workers (`streamrl.envs.runner`, `worker`,
`registry`, `config`) and for the bundled environments' episodes: real spawned workers, user
environments in tests/env_fns.py."""

from __future__ import annotations

import logging
import os
import time

import pytest
from pydantic import ValidationError

from streamrl.data.builtin import arithmetic_rows, math_rows
from streamrl.envs import (
    TOOL_FORMATS,
    EnvConfig,
    EnvContext,
    EnvLoadError,
    EnvResolutionError,
    EnvRunner,
    Episode,
    Reply,
    Scored,
    Task,
    check_env_name,
)
from streamrl.envs.guess import GuessEnv
from streamrl.rewards import math_reward
from streamrl.rewards.config import RewardConfig

SCRIPTED = "tests.env_fns:ScriptedTools"
MISBEHAVING = "tests.env_fns:Misbehaving"


def _task(row: dict, prompt_text: str = "") -> Task:
    return Task(row["prompt"], row["reward_model"]["ground_truth"], prompt_text, row)


def _episode(runner: EnvRunner, task: Task, turns: list[str]) -> tuple[list[Reply], Scored]:
    """Play `turns` as the model's (stopping when the episode ends) and score it."""
    replies = [runner.reset(task).result()]
    for text in turns:
        if replies[-1].episode.done:
            break
        replies.append(runner.step(replies[-1].episode, text).result())
    return replies, runner.score(replies[-1].episode).result()


def _call(tool: str, **arguments: object) -> str:
    return TOOL_FORMATS["hermes"].format_call(tool, arguments)


# -- configuration and names -----------------------------------------------------------------


def test_config_bounds_and_cross_field_rules() -> None:
    config = EnvConfig()
    assert (config.fn, config.tool_format, config.turn_max_tokens) == ("single_turn", "auto", None)
    with pytest.raises(ValidationError, match=r"call_timeout_s .* must be ≤ episode_timeout_s"):
        EnvConfig(call_timeout_s=20, episode_timeout_s=10)
    with pytest.raises(ValidationError, match=r"turn_max_tokens .* must be ≤ max_episode_tokens"):
        EnvConfig(turn_max_tokens=2048, max_episode_tokens=1024)
    with pytest.raises(ValidationError, match="neither the name of an environment"):
        EnvConfig(fn="my env")
    for field, value in {
        "max_turns": 0,
        "workers": 0,
        "memory_mb": 10,
        "call_timeout_s": 0,
    }.items():
        with pytest.raises(ValidationError):
            EnvConfig(**{field: value})


def test_names_fail_fast_with_the_fix() -> None:
    for name in ("single_turn", "calculator", "python", "guess", "my_pkg.envs:MyEnv"):
        check_env_name(name)
    with pytest.raises(EnvResolutionError, match="did you mean 'calculator'"):
        check_env_name("calculater")
    with pytest.raises(EnvResolutionError, match=r"with a colon: write it as 'pkg\.envs:MyEnv'"):
        check_env_name("pkg.envs.MyEnv")
    with pytest.raises(ValidationError, match="did you mean 'calculator'"):
        EnvConfig(fn="calculater")  # the configuration refuses it, before any worker starts


@pytest.mark.parametrize(
    ("fn", "reward", "message"),
    [
        ("tests.env_fns:ScriptedTool", "math", "did you mean 'tests.env_fns:ScriptedTools'"),
        ("tests.env_fns:NotAnEnvironment", "math", "not a subclass of streamrl.envs.Environment"),
        ("no_such_pkg.envs:Env", "math", "no module named 'no_such_pkg'"),
        ("guess", "tests.reward_fns:scriptd", "(generator.reward.fn)"),
    ],
)
def test_an_environment_the_workers_cannot_load_fails_on_entry(
    fn: str, reward: str, message: str
) -> None:
    runner = EnvRunner(EnvConfig(fn=fn, workers=1), reward=RewardConfig(fn=reward))
    with (
        pytest.raises(EnvResolutionError, match=message.replace("(", r"\(").replace(")", r"\)")),
        runner,
    ):
        pass


def test_only_what_may_load_next_time_is_a_load_error(tmp_path, monkeypatch) -> None:
    """A generator is restarted on an `EnvLoadError` (a module that raised on import, the
    environment's or the reward's), not on the rest (`streamrl generator`'s exit code 4)."""
    (tmp_path / "flaky_module.py").write_text("raise OSError('share not mounted')\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the spawned workers inherit sys.path
    for fn, reward in (("flaky_module:Env", "math"), ("guess", "flaky_module:reward")):
        runner = EnvRunner(EnvConfig(fn=fn, workers=1), reward=RewardConfig(fn=reward))
        with pytest.raises(EnvLoadError, match="OSError: share not mounted"), runner:
            pass
    runner = EnvRunner(EnvConfig(fn="no_such_pkg.envs:Env", workers=1))
    with pytest.raises(EnvResolutionError) as error, runner:
        pass
    assert not isinstance(error.value, EnvLoadError)


# -- the single-turn environment -------------------------------------------------------------


def test_single_turn_scores_as_the_reward_function_does() -> None:
    rows = arithmetic_rows(6)
    responses = [f"\\boxed{{{r['reward_model']['ground_truth']}}}" for r in rows[:3]]
    responses += [
        "The answer is 1000",
        "no idea",
        f"Answer: {rows[5]['reward_model']['ground_truth']}",
    ]
    with EnvRunner(EnvConfig(workers=2)) as runner:
        replies = [runner.reset(_task(row)).result() for row in rows]
        assert [r.messages for r in replies] == [row["prompt"] for row in rows]
        assert all(r.tools is None and not r.episode.tools_offered for r in replies)
        ended = [runner.step(r.episode, text) for r, text in zip(replies, responses, strict=True)]
        episodes = [future.result().episode for future in ended]
        scores = [runner.score(e).result() for e in episodes]
    expected = [
        math_reward(text, r["reward_model"]["ground_truth"])
        for text, r in zip(responses, rows, strict=True)
    ]
    assert expected == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]  # the reference: the function itself
    assert [s.reward for s in scores] == expected
    assert all((s.finish_reason, s.failure) == ("done", None) for s in scores)
    assert all((e.turns, e.final) == (1, text) for e, text in zip(episodes, responses, strict=True))
    assert runner.stats.finished == {"done": 6}


def test_single_turn_passes_the_prompt_to_the_reward() -> None:
    reward = RewardConfig(fn="tests.reward_fns:scripted", workers=1)
    with EnvRunner(EnvConfig(), reward=reward) as runner:
        task = Task([{"role": "user", "content": "q"}], "rendered prompt", "rendered prompt")
        _, scored = _episode(runner, task, ["prompt"])
        assert scored.reward == 1.0
        _, failed = _episode(runner, task, ["return:1.5"])  # the reward's own failure
        assert (failed.reward, failed.failure) == (0.0, "error")
        assert runner.stats.errors == 1


# -- isolation: crashes, hangs, credentials, malformed answers --------------------------------


def test_a_crashing_and_a_hanging_tool_end_their_episodes_and_others_go_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="streamrl.envs.runner")
    task = Task([{"role": "user", "content": "go"}], "ok")
    config = EnvConfig(fn=SCRIPTED, workers=2, call_timeout_s=2.0, tool_format="hermes")
    with EnvRunner(config) as runner:
        started = [runner.reset(task).result() for _ in range(3)]
        assert started[0].tools is not None
        assert {t["function"]["name"] for t in started[0].tools} >= {"crash", "hang"}
        crashed = runner.step(started[0].episode, _call("crash")).result()
        assert crashed.episode.finish_reason == "env_error"
        assert crashed.messages == []
        assert "its worker process died" in crashed.episode.error

        began = time.monotonic()
        hung = runner.step(started[1].episode, _call("hang"))
        quick = [
            runner.step(started[2].episode, _call("echo", text="hi", times=2)) for _ in range(4)
        ]
        answers = [f.result() for f in quick]  # served while the hang holds a worker
        assert all(
            a.messages == [{"role": "tool", "name": "echo", "content": "hihi"}] for a in answers
        )
        assert not hung.done()
        timed_out = hung.result()
        assert 2.0 <= time.monotonic() - began < 15.0
        assert timed_out.episode.finish_reason == "timeout"
        assert timed_out.episode.env_s >= 2.0

        # Reset before the crash, stepped on the workers after it and again on those after
        # the timeout: an episode outlives the workers that served it.
        after = runner.step(answers[0].episode, "All done: \\boxed{ok}").result()
        assert after.episode.finish_reason == "done"
        scores = [runner.score(r.episode).result() for r in (crashed, timed_out, after)]
        stats = runner.stats
    assert [(s.reward, s.failure) for s in scores] == [
        (0.0, "error"),
        (0.0, "timeout"),
        (1.0, None),
    ]
    assert (stats.errors, stats.timeouts, stats.pool_restarts) == (1, 1, 2)
    assert stats.finished == {"env_error": 1, "timeout": 1, "done": 1}
    assert "a step call failed (env_error) at turn 0: its worker process died" in caplog.text
    assert "Raise generator.env.call_timeout_s" in caplog.text


def test_a_tool_that_raises_is_an_observation_not_a_failure() -> None:
    task = Task([{"role": "user", "content": "go"}], "ok")
    with EnvRunner(EnvConfig(fn=SCRIPTED, workers=1, tool_format="hermes")) as runner:
        started = runner.reset(task).result()
        assert started.episode.tools_offered  # recorded with the group: tool use is watched
        reply = runner.step(started.episode, _call("boom") + _call("nope")).result()
        assert not reply.episode.done
        assert [m["content"] for m in reply.messages] == [
            "Error: ValueError: boom",
            "Error: unknown tool 'nope'; the tools are: boom, crash, echo, getenv, hang, nap",
        ]
        assert (reply.episode.tool_calls, reply.episode.tool_errors) == (2, 2)
        assert runner.stats.errors == 0


def test_workers_hold_no_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Secrets under names no rule knows too (MY_DB_DSN, WEIRD): a worker's environment is an
    allowlist; PATH and HOME are on it."""
    for name in ("AWS_SECRET_ACCESS_KEY", "HF_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.setenv(name, "planted")
    monkeypatch.setenv("MY_DB_DSN", "postgres://rewards:planted@db.internal/rewards")
    monkeypatch.setenv("WEIRD", "planted")
    monkeypatch.setenv("STREAMRL_HARMLESS", "kept")
    monkeypatch.setenv("HOME", "/home/kept")
    task = Task([{"role": "user", "content": "go"}], "ok")
    with EnvRunner(EnvConfig(fn=SCRIPTED, workers=1, tool_format="tagged")) as runner:
        episode = runner.reset(task).result().episode
        names = [
            "AWS_SECRET_ACCESS_KEY",
            "HF_TOKEN",
            "AWS_ENDPOINT_URL",
            "MY_DB_DSN",
            "WEIRD",
            "STREAMRL_HARMLESS",
            "HOME",
            "PATH",
        ]
        text = "".join(f'<tool>getenv(name="{n}")</tool>' for n in names)
        (observation,) = runner.step(episode, text).result().messages
    values = [block.split("\n")[1] for block in observation["content"].split("<tool_result")[1:]]
    assert values == [*["absent"] * 5, "kept", "/home/kept", os.environ["PATH"]]


@pytest.mark.parametrize(
    ("turn", "problem"),
    [
        ("state", "step's state is not plain JSON"),
        ("silent", "returned no messages for an episode that goes on"),
        ("raise", "RuntimeError: environment bug"),
    ],
)
def test_malformed_answers_end_the_episode_as_env_error(turn: str, problem: str, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="streamrl.envs.runner")
    with EnvRunner(EnvConfig(fn=MISBEHAVING, workers=1)) as runner:
        replies, scored = _episode(
            runner, Task([{"role": "user", "content": "go"}], "x"), ["hello", turn]
        )
        assert replies[1].messages == [{"role": "user", "content": "echo hello"}]
        assert replies[-1].episode.finish_reason == "env_error"
        assert problem in replies[-1].episode.error
        assert problem in caplog.text
        assert (scored.reward, scored.failure, scored.turn_rewards) == (0.0, "error", (0.1,))
        bad_reset = runner.reset(Task([{"role": "user", "content": "go"}], "bad reset")).result()
        assert bad_reset.episode.finish_reason == "env_error"
        assert "reset returned {'not': 'a Reset'}, not a Reset" in bad_reset.episode.error
        assert runner.stats.errors == 2


def test_scores_are_checked_and_turn_rewards_recorded() -> None:
    with EnvRunner(EnvConfig(fn=MISBEHAVING, workers=1)) as runner:
        task = Task([{"role": "user", "content": "go"}], "x")
        outcomes = {
            text: _episode(runner, task, ["a", "b", text])[1]
            for text in ("score:1", "score:true", "score:1.5", "score:text")
        }
    assert outcomes["score:1"] == Scored(1.0, (0.1, 0.1, 0.5), "done")
    assert outcomes["score:true"].reward == 1.0
    assert (outcomes["score:1.5"].reward, outcomes["score:1.5"].failure) == (0.0, "error")
    assert outcomes["score:text"].failure == "error"


def test_max_turns_and_the_episode_time_limit_end_episodes() -> None:
    task = Task([{"role": "user", "content": "go"}], "ok")
    config = EnvConfig(
        fn=SCRIPTED,
        workers=1,
        max_turns=2,
        call_timeout_s=5.0,
        episode_timeout_s=5.0,
        tool_format="hermes",
    )
    with EnvRunner(config) as runner:
        replies, scored = _episode(runner, task, [_call("echo", text="a")] * 5)
        assert [r.episode.turns for r in replies] == [0, 1, 2]
        assert replies[-1].episode.finish_reason == "max_turns"
        assert replies[-1].messages == []
        assert (scored.finish_reason, scored.failure) == ("max_turns", None)

        replies, scored = _episode(runner, task, [_call("nap", seconds=3.0)] * 2)
        assert replies[1].episode.finish_reason is None
        assert replies[1].episode.env_s >= 3.0
        assert replies[2].episode.finish_reason == "timeout"  # 3 s more would pass the 5 s
        assert replies[2].episode.env_s >= 5.0
        assert (scored.reward, scored.failure) == (0.0, "timeout")
        spent = Episode(task, None, env_s=5.0)
        out_of_time = runner.step(spent, _call("echo", text="a")).result()
        assert out_of_time.episode.finish_reason == "timeout"
        assert "episode_timeout_s=5 used up" in out_of_time.episode.error
        assert runner.stats.timeouts == 2
        with pytest.raises(ValueError, match="ended"):
            runner.step(out_of_time.episode, "more")
        with pytest.raises(ValueError, match="still running"):
            runner.score(replies[1].episode)


# -- the bundled environments ----------------------------------------------------------------


def _guess(texts: list[str], truth: str = "12") -> tuple[list[object], float]:
    env = GuessEnv(EnvContext(math_reward, "math", TOOL_FORMATS["tagged"]))
    task = Task([{"role": "user", "content": "What is 3 * 4?"}], truth)
    state, steps = env.reset(task).state, []
    for text in texts:
        step = env.step(task, state, text)
        steps.append(step)
        state = step.state
        if step.done:
            break
    return steps, env.score(task, state, texts[-1])


def test_guess_hints_higher_or_lower_until_right_or_out_of_guesses() -> None:
    steps, score = _guess(["\\boxed{12}"])
    assert (len(steps), steps[0].done, steps[0].reward, score) == (1, True, 1.0, 1.0)

    steps, score = _guess(["I think \\boxed{9}", "then 15", "Answer: 12.0"])
    assert [s.messages[0]["content"].split(".")[0] for s in steps[:2]] == [
        "9 is too low",
        "15 is too high",
    ]
    assert "3 guesses left" in steps[0].messages[0]["content"]
    assert [s.reward for s in steps] == [0.0, 0.0, 1.0]
    assert steps[-1].done
    assert score == 0.25  # right on the third guess: halved twice

    steps, score = _guess(["no idea", "24/2"])
    assert steps[0].messages[0]["content"].startswith("I could not find a number")
    assert score == 0.5

    steps, score = _guess(["1", "2", "3", "4", "5"])
    assert len(steps) == 4
    assert steps[-1].done
    assert steps[-1].messages == []
    assert score == 0.0
    with pytest.raises(ValueError, match="needs a number as ground truth"):
        _guess(["1"], truth="x^2")


def test_guess_and_calculator_through_the_runner() -> None:
    row = arithmetic_rows(1)[0]
    a, b, op = (row["extra_info"][k] for k in ("a", "b", "op"))
    truth = int(row["reward_model"]["ground_truth"])
    with EnvRunner(EnvConfig(fn="guess", workers=1, max_turns=2)) as runner:
        replies, scored = _episode(runner, _task(row), [str(truth + 1), str(truth + 2), str(truth)])
        assert replies[1].messages[0]["content"].startswith(f"{truth + 1} is too high")
        assert (replies[-1].episode.finish_reason, scored.reward) == ("max_turns", 0.0)
        assert scored.turn_rewards == (0.0, 0.0)
    with EnvRunner(EnvConfig(fn="calculator", workers=1), chat_template="{{ tools }}") as runner:
        assert runner.tool_format == "hermes"
        replies, scored = _episode(
            runner,
            _task(row),
            [_call("calculate", expression=f"{a} {op} {b}"), f"\\boxed{{{truth}}}"],
        )
        assert replies[1].messages == [{"role": "tool", "name": "calculate", "content": str(truth)}]
        assert (scored.reward, replies[-1].episode.turns) == (1.0, 2)


def test_python_env_solves_a_math_row_with_code() -> None:
    row = math_rows()[8]  # What is 2^{10}?
    assert row["reward_model"]["ground_truth"] == "1024"
    with EnvRunner(EnvConfig(fn="python", workers=1, tool_format="tagged")) as runner:
        replies, scored = _episode(
            runner, _task(row), ['<tool>python(code="print(2 ** 10)")</tool>', "So \\boxed{1024}."]
        )
    assert "python(code: string)" in replies[0].messages[0]["content"]
    assert replies[1].messages == [
        {"role": "user", "content": '<tool_result name="python">\n1024\n\n</tool_result>'}
    ]
    assert scored == Scored(1.0, (None, None), "done")


def test_runner_futures_serve_many_episodes_from_threads() -> None:
    from concurrent.futures import ThreadPoolExecutor

    rows = arithmetic_rows(8)
    with (
        EnvRunner(EnvConfig(fn="calculator", workers=2, tool_format="tagged")) as runner,
        ThreadPoolExecutor(4) as threads,
    ):

        def play(row: dict) -> float:
            truth = row["reward_model"]["ground_truth"]
            expression = (
                f"{row['extra_info']['a']} {row['extra_info']['op']} {row['extra_info']['b']}"
            )
            return _episode(
                runner, _task(row), [f'<tool>calculate(expression="{expression}")</tool>', truth]
            )[1].reward

        assert list(threads.map(play, rows)) == [1.0] * 8
        assert runner.stats.steps == 16
        assert runner.stats.finished == {"done": 8}
