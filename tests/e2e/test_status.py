"""`streamrl status` on real runs of the tiny model: a finished run trained in-process on a
pre-written stream, a live learner subprocess waiting on its stream, a run with only run.json,
a run on S3 (SeaweedFS) and an unknown URI. Every figure is checked against what storage and
the learner hold."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from storage.checkpoints.dcp import CheckpointStore
from storage.control.manifest import create_run
from storage.control.requests import request_stop
from storage.fs import Location, StorageError, open_location
from storage.stream.records import Cursor
from storage.stream.writer import StreamWriter, quarantined, read_log
from storage.weights.versions import WeightStore
from streamrl.config.loading import load_config
from streamrl.generator.index import hold_generator_index
from streamrl.learner.loop import Learner
from streamrl.learner.topology import Topology
from streamrl.runs.status import FINISHED, NOT_STARTED, RUNNING, STOPPING, read_status
from streamrl.runs.status_format import format_status, to_json
from tests.stream_data import random_group

ROOT = Path(__file__).resolve().parents[2]
SEGMENT_GROUPS = 4


def _config(run_dir: Path | str, total_steps: int, *extra: str):
    return load_config(
        ["dapo", "tiny-cpu"],
        overrides=[
            f"storage.run_uri={run_dir}",
            f"learner.total_steps={total_steps}",
            "learner.batch_groups=4",
            "learner.mini_batch_groups=4",
            "learner.max_staleness=100",  # the pre-written stream is all version 0
            "generator.max_tokens=24",
            *extra,
        ],
    )


def _create(run_dir: Path, config) -> None:
    create_run(open_location(str(run_dir)), config.model_dump(mode="json"))


def _write_stream(run: Location, groups: int, *, first: int = 0, writer: str = "gen0") -> None:
    """`groups` random groups in segments of SEGMENT_GROUPS (the last one may be shorter)."""
    rng = np.random.default_rng(first)
    stream = StreamWriter(run, writer)
    made = [
        random_group(rng, prompt_id=f"p{i}", vocab=600, max_len=24, prompt_len=10)
        for i in range(first, first + groups)
    ]
    for start in range(0, groups, SEGMENT_GROUPS):
        stream.write(made[start : start + SEGMENT_GROUPS])


def _metrics_lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics" / "learner.jsonl").open()]


def _logged_step(status) -> int:
    return 0 if status.last_metrics is None else status.last_metrics["step"]


def _status_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "streamrl", "status", *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Learner]:
    """A DAPO run trained to its 3 steps in this process: checkpoints at 2 and 3, stopped."""
    run_dir = tmp_path_factory.mktemp("status") / "finished"
    config = _config(run_dir, 3, "learner.checkpoint_every=2")
    _create(run_dir, config)
    _write_stream(open_location(str(run_dir)), 40)
    with Topology.from_env("cpu") as topology:
        learner = Learner(config, open_location(str(run_dir)), topology)
        assert learner.run() == 3
    return run_dir, learner


def test_status_of_a_finished_run_equals_what_storage_holds(finished_run):
    run_dir, learner = finished_run
    run = open_location(str(run_dir))
    status = read_status(run)
    last = _metrics_lines(run_dir)[-1]
    checkpoint = CheckpointStore(run).read_state(3)

    assert status.state == FINISHED
    assert "learner reached 3 steps" in status.stop_reason
    assert (status.step, status.total_steps) == (3, 3)
    assert status.policy_version == last["policy_version"] == learner.state.version == 3
    assert (status.checkpoint_step, status.checkpoint_version) == (3, 3)
    assert status.weight_version == WeightStore(run).latest_version() == 3
    assert (status.algorithm, status.model) == ("dapo", "tiny-qwen2")

    records = list(read_log(run))
    assert status.stream.commits == len(records) == 10
    assert status.stream.groups == sum(r.num_groups for r in records) == 40
    # Consumed, three ways: the learner's own count, its last metrics line, its checkpoint
    # cursor counted in whole segments of SEGMENT_GROUPS.
    cursor = Cursor.from_dict(checkpoint.stream_cursor)
    consumed = learner.stream.collector.totals.consumed
    assert consumed == last["stream/consumed_total"] == SEGMENT_GROUPS * cursor.seq + cursor.offset
    assert status.consumed_groups == consumed
    assert status.consumed_source.startswith("learner metrics")
    assert status.lag_groups == 40 - consumed
    assert status.last_metrics == last
    assert status.last_metrics["rollout/reward_mean"] == last["rollout/reward_mean"]

    (generator,) = status.stream.generators
    assert (generator.writer_id, generator.groups, generator.commits) == ("gen0", 40, 10)
    assert generator.last_commit_at == max(r.committed_at for r in records)
    assert status.newest_write_age_s >= 0

    table = format_status(status)
    assert "finished" in table
    assert "step 3/3" in table
    assert f"reward {last['rollout/reward_mean']:+.3f}" in table
    assert f"lag: {40 - consumed} groups" in table


def test_status_command_prints_the_figures_and_json(finished_run):
    run_dir, learner = finished_run
    consumed = learner.stream.collector.totals.consumed
    shown = _status_cli(str(run_dir))
    assert shown.returncode == 0, shown.stderr
    assert "finished" in shown.stdout
    assert "step 3/3" in shown.stdout
    assert f"consumed: {consumed} groups" in shown.stdout
    assert "gen0: 40 groups in 10 commits" in shown.stdout
    # The curves under the status: a text chart per metric, first → last value of the 3 steps.
    rewards = [line["rollout/reward_mean"] for line in _metrics_lines(run_dir)]
    assert "curves     steps 1..3" in shown.stdout
    (reward,) = [line for line in shown.stdout.splitlines() if "reward (mean)" in line]
    assert f"{rewards[0]:+.3f} → {rewards[-1]:+.3f}" in reward

    plotted = _status_cli(str(run_dir), "--plot", str(run_dir / "curves.png"))
    assert plotted.returncode == 0, plotted.stderr
    assert (run_dir / "curves.png").read_bytes().startswith(b"\x89PNG")
    assert "curves drawn into" in plotted.stderr

    as_json = _status_cli(str(run_dir), "--json", "--watch", "0.5")  # finished: one, then exit
    assert as_json.returncode == 0, as_json.stderr
    (line,) = as_json.stdout.splitlines()
    body = json.loads(line)
    assert (body["state"], body["step"], body["policy_version"]) == ("finished", 3, 3)
    assert (body["stream"]["groups"], body["consumed_groups"]) == (40, consumed)
    assert body["lag_groups"] == 40 - consumed


def test_quarantined_segments_are_shown_and_left_out_of_the_lag(tmp_path):
    """A real learner trains past a corrupted segment (it quarantines it and logs
    stream/quarantined_total); the status counts it apart and the lag leaves its groups out,
    whether consumption comes from the learner's metrics or from its checkpoint's cursor."""
    from flows.artifacts import metrics_table

    run_dir = tmp_path / "quarantine"
    config = _config(run_dir, 3, "learner.checkpoint_every=2")
    _create(run_dir, config)
    run = open_location(str(run_dir))
    _write_stream(run, 40)
    corrupt = list(read_log(run))[1]
    key = sorted(corrupt.objects)[0]
    path = run.join("stream", "segments", corrupt.segment, key)
    run.fs.pipe_file(path, bytes(b ^ 0xFF for b in run.fs.cat_file(path)))
    with Topology.from_env("cpu") as topology:
        learner = Learner(config, run, topology)
        assert learner.run() == 3

    assert quarantined(run) == [1]
    status = read_status(run)
    consumed = learner.stream.collector.totals.consumed
    last = _metrics_lines(run_dir)[-1]
    assert consumed == last["stream/consumed_total"] == status.consumed_groups
    assert (status.stream.quarantined, status.stream.quarantined_groups) == (1, SEGMENT_GROUPS)
    assert status.stream.groups == 40
    assert status.lag_groups == 40 - SEGMENT_GROUPS - consumed
    checkpoint = CheckpointStore(run).read_state(3)
    assert status.stream.groups_at(Cursor.from_dict(checkpoint.stream_cursor)) == consumed
    table = format_status(status)
    assert "quarantined: 1 segment (4 groups)" in table
    assert f"lag: {40 - SEGMENT_GROUPS - consumed} groups" in table
    assert json.loads(to_json(status))["stream"]["quarantined"] == 1

    assert last["stream/quarantined_total"] == 1
    assert "| quarantined segments (total) | 1 |" in metrics_table(last, 3, None, status.stream)


def test_reward_failures_are_shown_per_generator_and_in_all(tmp_path):
    """Counts from the commit records; a record written before they existed counts none."""
    from flows.artifacts import metrics_table

    run_dir = tmp_path / "rewards"
    _create(run_dir, _config(run_dir, 5))
    run = open_location(str(run_dir))
    rng = np.random.default_rng(0)
    groups = [random_group(rng, prompt_id=f"p{i}", vocab=600) for i in range(8)]
    gen0, gen1 = StreamWriter(run, "gen0"), StreamWriter(run, "gen1")
    gen0.count_reward_failures(errors=4, timeouts=1, dropped_groups=2)
    gen0.write(groups[:3])
    old = gen1.write(groups[3:5])
    gen0.count_reward_failures(errors=3, dropped_groups=1)
    gen0.write(groups[5:])
    body = json.loads(old.to_json())
    for key in ("reward_errors", "reward_timeouts", "reward_dropped_groups"):
        del body[key]
    (run_dir / "stream" / "log" / f"{old.seq:012d}.json").write_text(json.dumps(body))

    status = read_status(run)
    gen0_status, gen1_status = status.stream.generators
    tally = status.stream
    assert (tally.reward_errors, tally.reward_timeouts, tally.reward_dropped_groups) == (7, 1, 3)
    assert (gen0_status.reward_errors, gen0_status.reward_timeouts) == (7, 1)
    assert gen0_status.reward_dropped_groups == 3
    assert (gen1_status.reward_errors, gen1_status.reward_timeouts) == (0, 0)
    assert gen1_status.reward_dropped_groups == 0
    failures = "7 reward errors, 1 reward timeout, 3 groups dropped for them"
    table = format_status(status).splitlines()
    assert f"rewards    {failures} in all" in table
    assert any(
        line.startswith("generators gen0: 6 groups") and f"; {failures}" in line for line in table
    )
    assert any("gen1: 2 groups" in line and "reward" not in line for line in table)

    gen1.count_reward_failures(timeouts=2)
    gen1.write(groups[:1])
    again = read_status(run, previous=status)  # the tally continues from the first read
    assert (again.stream.reward_errors, again.stream.reward_timeouts) == (7, 3)
    assert again.stream.generators[1].reward_timeouts == 2

    shown = _status_cli(str(run_dir), "--json")
    assert shown.returncode == 0, shown.stderr
    stream = json.loads(shown.stdout)["stream"]
    keys = ("reward_errors", "reward_timeouts", "reward_dropped_groups")
    assert [stream[k] for k in keys] == [7, 3, 3]
    markdown = metrics_table({"step": 1}, 5, None, again.stream)
    assert "| reward errors / timeouts / groups dropped (total) | 7 / 3 / 3 |" in markdown
    assert "| reward errors / timeouts / groups dropped (gen0) | 7 / 1 / 3 |" in markdown
    assert "| reward errors / timeouts / groups dropped (gen1) | 0 / 2 / 0 |" in markdown


def test_status_follows_a_live_learner_to_its_end(tmp_path):
    """Without dynamic sampling each step consumes exactly 4 groups: with 6 written, the
    learner does step 1 and then waits on the stream; 6 more let it finish step 3."""
    run_dir = tmp_path / "live"
    config = _config(
        run_dir,
        3,
        "algorithm.dynamic_sampling=false",
        "learner.checkpoint_every=1",
        "learner.stream_timeout_s=600",
    )
    _create(run_dir, config)
    run = open_location(str(run_dir))
    _write_stream(run, 6)
    learner = subprocess.Popen(
        [sys.executable, "-m", "streamrl", "learner", "--run", str(run_dir)],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        status = read_status(run)
        deadline = time.monotonic() + 300
        # The metrics line is the last thing a step writes (after weights and checkpoint).
        while not _logged_step(status) and learner.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            status = read_status(run, previous=status)
        assert status.step == 1, learner.stderr.read() if learner.poll() is not None else ""
        assert status.state == RUNNING
        assert status.stop_reason is None
        assert (status.policy_version, status.checkpoint_step, status.weight_version) == (1, 1, 1)
        assert status.stream.groups == 6
        assert status.consumed_groups == 4 == status.last_metrics["stream/consumed_total"]
        assert status.lag_groups == 2
        checkpoint = CheckpointStore(run).read_state(1)
        assert status.stream.groups_at(Cursor.from_dict(checkpoint.stream_cursor)) == 4

        _write_stream(run, 6, first=6)
        _, errors = learner.communicate(timeout=300)
        assert learner.returncode == 0, errors
    finally:
        if learner.poll() is None:
            learner.kill()
            learner.wait()

    status = read_status(run, previous=status)  # the tally continues from the live one
    assert status.state == FINISHED
    assert (status.step, status.policy_version, status.checkpoint_step) == (3, 3, 3)
    assert status.stream.commits == 4  # 4 + 2 groups, then 4 + 2 more
    assert (status.stream.groups, status.consumed_groups, status.lag_groups) == (12, 12, 0)
    assert len(status.stream.generators[0].incarnations) == 2  # two StreamWriters


def test_a_run_with_only_its_configuration_is_not_started_then_stopping(tmp_path):
    run_dir = tmp_path / "fresh"
    _create(run_dir, _config(run_dir, 5))
    run = open_location(str(run_dir))
    status = read_status(run)
    assert status.state == NOT_STARTED
    assert (status.step, status.total_steps, status.policy_version) == (0, 5, None)
    assert status.checkpoint_step is None
    assert status.weight_version is None
    assert (status.stream.commits, status.consumed_groups, status.lag_groups) == (0, None, None)
    assert status.last_metrics is None
    assert status.last_eval is None
    table = format_status(status)
    assert "not started" in table
    assert "no learner step logged yet" in table

    request_stop(run, "stopped by the user")
    stopped = read_status(run)
    assert stopped.state == STOPPING
    assert stopped.stop_reason == "stopped by the user"


def test_status_reads_the_object_store_layout(seaweedfs):
    """On S3 the learner and the evaluator write one metrics object per record (no appends)."""
    uri = f"s3://{seaweedfs.bucket}/runs/status-{uuid.uuid4().hex[:8]}"
    run = open_location(uri, storage_options=seaweedfs.storage_options)
    create_run(run, _config(uri, 4).model_dump(mode="json"))
    _write_stream(run, 6, writer="gen0")
    _write_stream(run, 3, first=6, writer="gen1")
    now = time.time()
    for step in (1, 2):
        line = {
            "time": now,
            "step": step,
            "policy_version": step,
            "stream/consumed_total": 4 * step,
            "rollout/reward_mean": 0.1 * step,
        }
        run.fs.pipe_file(run.join("metrics", f"learner-{step:08d}.json"), json.dumps(line).encode())
    record = {"time": now, "version": 2, "val/acc_greedy": 0.5, "val/avg@4": 0.25}
    run.fs.pipe_file(run.join("metrics", "eval-v2-1.json"), json.dumps(record).encode())
    request_stop(run, "stopped by the user")

    status = read_status(run)
    assert status.state == STOPPING
    assert (status.step, status.total_steps, status.policy_version) == (2, 4, 2)
    assert status.checkpoint_step is None
    assert (status.stream.commits, status.stream.groups) == (3, 9)  # 4 + 2 from gen0, 3 from gen1
    assert [(g.writer_id, g.groups) for g in status.stream.generators] == [("gen0", 6), ("gen1", 3)]
    assert (status.consumed_groups, status.lag_groups) == (8, 1)
    assert status.last_metrics["rollout/reward_mean"] == pytest.approx(0.2)
    assert (status.last_eval["version"], status.evaluations) == (2, 1)

    shown = _status_cli(uri, "--json", env=seaweedfs.env)
    assert shown.returncode == 0, shown.stderr
    body = json.loads(shown.stdout)
    assert (body["state"], body["step"], body["lag_groups"]) == ("stopping", 2, 1)


def test_an_unknown_run_is_a_clear_error(tmp_path):
    missing = tmp_path / "no-such-run"
    with pytest.raises(StorageError, match="no streamrl run at"):
        read_status(open_location(str(missing), check=False))
    shown = _status_cli(str(missing))
    assert shown.returncode == 2
    assert str(missing) in shown.stderr
    assert "no streamrl run" in shown.stderr
    assert "Traceback" not in shown.stderr
    assert not missing.exists()  # status never creates a run folder


def test_a_resumed_generator_counts_as_a_resume_and_a_crashed_one_as_a_restart(tmp_path):
    """Its index lease's epochs tell them apart: a start after a released lease (a clean stop:
    SIGTERM, Ctrl-C) is a resume; one after a lease left held (killed) is a restart."""
    run_dir = tmp_path / "lives"
    _create(run_dir, _config(run_dir, 5))
    run = open_location(str(run_dir))
    _write_stream(run, 2)
    hold_generator_index(run, 0).release()  # started and stopped cleanly
    with hold_generator_index(run, 0, ttl_s=2.0):  # resumed: taken at once
        pass
    killed = hold_generator_index(run, 0, ttl_s=1.0)  # resumed again, then killed:
    killed.lease._stop.set()  # its lease is never released
    hold_generator_index(run, 0, take_over=True).release()  # restarted by a supervisor
    generator = read_status(run).stream.generators[0]
    assert (generator.restarts, generator.resumes) == (1, 2)
    assert "gen0: 2 groups in 1 commits" in format_status(read_status(run))
    assert ", 1 restart, 2 resumes" in format_status(read_status(run))
