"""One learner per run, with real learner processes on a local folder and on SeaweedFS: a second
learner refuses a live run; a learner stopped past its lease (SIGSTOP) is taken over, and once
it runs again it writes nothing more — the run's checkpoints and versions are the successor's
alone, and the successor's resume is exact. (The SeaweedFS variants are `slow`: ~2 min.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from storage.checkpoints.dcp import CheckpointStore
from storage.control.lease import NOT_HOLDER_EXIT_CODE, read_lease
from storage.control.manifest import create_run
from storage.fs import Location, open_location
from storage.stream.writer import StreamWriter
from storage.weights.versions import WeightStore
from streamrl.config.loading import load_config
from tests.stream_data import random_group

ROOT = Path(__file__).resolve().parents[3]
TTL_S = 6.0
STEPS = 8


def _env(backend: str, request: pytest.FixtureRequest) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    if backend == "s3":
        env.update(request.getfixturevalue("seaweedfs").env)
    return env


def _create(uri: str, options: dict, *, write_stream: bool = True) -> Location:
    config = load_config(
        ["dapo", "tiny-cpu"],
        overrides=[
            f"storage.run_uri={uri}",
            f"learner.total_steps={STEPS}",
            "learner.batch_groups=4",
            "learner.mini_batch_groups=2",
            "learner.checkpoint_every=2",
            "learner.max_staleness=100",  # the pre-written stream is all version 0
            f"learner.lease_ttl_s={TTL_S}",
            "learner.lr=1e-3",
            "weights.keep_versions=20",
            "generator.max_tokens=24",
        ],
    )
    run = open_location(uri, storage_options=options)
    create_run(run, config.model_dump(mode="json"))
    if write_stream:
        _write_stream(run, 0, 4 * STEPS + 8)
    return run


def _write_stream(run: Location, start: int, stop: int) -> None:
    """Groups `start`..`stop` of one fixed random stream, 4 to a segment."""
    rng, writer = np.random.default_rng(0), StreamWriter(run, f"gen{start}")
    for n in range(0, stop, 4):
        groups = [
            random_group(rng, prompt_id=f"p{n + i}", vocab=600, max_len=24, prompt_len=10)
            for i in range(4)
        ]
        if n >= start:
            writer.write(groups)


def _learner(uri: str, env: dict, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "streamrl", "learner", "--run", uri, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(condition, what: str, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _epochs_of_writes(run: Location) -> tuple[dict[int, int | None], dict[int, int | None]]:
    """Checkpoint step → the epoch its COMMITTED names; weight version → its manifest's."""
    checkpoints = CheckpointStore(run)
    steps = {}
    for step in checkpoints.committed_steps():
        committed = run.join("checkpoints", f"step-{step:08d}", "COMMITTED")
        steps[step] = json.loads(run.fs.cat_file(committed)).get("epoch")
    store = WeightStore(run)
    return steps, {v: store.read_manifest(v).epoch for v in store.versions()}


@pytest.mark.parametrize("backend", ["local", pytest.param("s3", marks=pytest.mark.slow)])
def test_a_second_learner_on_a_live_run_refuses_naming_the_holder(
    backend, run_uri_and_options, request
):
    uri, options = run_uri_and_options
    run, env = _create(uri, options, write_stream=False), _env(backend, request)
    first = _learner(uri, env)  # waits for groups: live, holding the run
    try:
        _wait_for(lambda: read_lease(run) is not None, "the first learner's lease")
        second = _learner(uri, env)
        _, errors = second.communicate(timeout=120)
        assert second.returncode == NOT_HOLDER_EXIT_CODE, errors
        assert "another learner holds the run's lease" in errors
        assert "--take-over" in errors
        assert f"pid {first.pid}" in errors
        _write_stream(run, 0, 4 * STEPS + 8)
        _, errors = first.communicate(timeout=300)
        assert first.returncode == 0, errors
    finally:
        first.kill()
    assert WeightStore(run).versions() == list(range(1, STEPS + 1))
    assert read_lease(run).released  # a successor may start at once


@pytest.mark.parametrize("backend", ["local", pytest.param("s3", marks=pytest.mark.slow)])
def test_a_stopped_learner_taken_over_writes_nothing_more_and_the_resume_is_exact(
    backend, run_uri_and_options, request, tmp_path
):
    uri, options = run_uri_and_options
    run, env = _create(uri, options), _env(backend, request)
    straight_uri = str(tmp_path / "straight")  # the same stream, one uninterrupted learner
    _create(straight_uri, {})
    straight = _learner(straight_uri, env)

    a = _learner(uri, env)
    checkpoints = CheckpointStore(run)
    _wait_for(lambda: checkpoints.committed_steps(), "learner A's first checkpoint")
    os.kill(a.pid, signal.SIGSTOP)
    try:
        stopped_at = (checkpoints.committed_steps(), WeightStore(run).versions())
        time.sleep(TTL_S + 1.0)  # A's lease expires
        b = _learner(uri, env)
        _wait_for(lambda: read_lease(run).epoch == 2, "learner B's lease")
    finally:
        os.kill(a.pid, signal.SIGCONT)
    _, a_errors = a.communicate(timeout=120)
    assert a.returncode == NOT_HOLDER_EXIT_CODE, a_errors
    assert "took the run over" in a_errors
    _, b_errors = b.communicate(timeout=300)
    assert b.returncode == 0, b_errors

    steps, versions = _epochs_of_writes(run)
    resumed_step = max(stopped_at[0])
    assert all(epoch == 2 for step, epoch in steps.items() if step > resumed_step), steps
    assert all(epoch == 2 for v, epoch in versions.items() if v > max(stopped_at[1])), versions
    assert sorted(versions) == list(range(1, STEPS + 1))

    _, errors = straight.communicate(timeout=300)
    assert straight.returncode == 0, errors
    expected, _ = WeightStore(open_location(straight_uri)).load(STEPS)
    actual, _ = WeightStore(run).load(STEPS)
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
