"""A learner stopped by SIGTERM (a preempted spot machine, a supervisor stopping the run)
commits a checkpoint of the step in hand before it exits, so a resume loses no step and ends
bit-identical to a run never stopped: real learner processes on the tiny model."""

from __future__ import annotations

import json
import signal
import time

import torch

from storage.checkpoints.dcp import CheckpointStore
from storage.control.lease import read_lease
from storage.control.manifest import create_run
from storage.fs import open_location
from storage.stream.learner_progress import read_learner_progress
from storage.weights.versions import WeightStore
from tests.integration.learner.test_loop import (
    TEMPORAL,
    _config,
    _learner_process,
    _write_stream,
)

STEPS = 8
NO_PERIODIC = "learner.checkpoint_every=1000"  # only the checkpoint on stop (and the last)


def _run(run_dir, groups: int, *extra: str):
    location = open_location(str(run_dir))
    config = _config(run_dir, STEPS, *TEMPORAL, NO_PERIODIC, *extra)
    create_run(location, config.model_dump(mode="json"))
    _write_stream(run_dir, groups, prompts=6)
    return location


def _wait_for(condition, what: str, proc, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"the learner ended before {what}: {proc.stderr.read()}"
        assert time.monotonic() < deadline, f"no {what} in {timeout_s} s"
        time.sleep(0.02)


def test_sigterm_mid_step_commits_a_checkpoint_and_the_resume_is_bit_exact(tmp_path):
    straight = _run(tmp_path / "straight", 80)
    proc = _learner_process(tmp_path / "straight")
    _, errors = proc.communicate(timeout=300)
    assert proc.returncode == 0, errors

    stopped = _run(tmp_path / "stopped", 80)
    proc = _learner_process(tmp_path / "stopped")
    weights = WeightStore(stopped)
    # Version 3 is published at the end of step 3: step 4 is training when SIGTERM comes.
    _wait_for(lambda: (weights.latest_version() or 0) >= 3, "version 3", proc)
    proc.send_signal(signal.SIGTERM)
    _, errors = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, errors
    assert "a resume loses nothing" in errors
    steps = CheckpointStore(stopped).committed_steps()
    assert len(steps) == 1
    assert 3 <= steps[0] < STEPS  # the step in hand was finished, then checkpointed
    assert read_lease(stopped).released  # the resume needs no --take-over

    proc = _learner_process(tmp_path / "stopped")
    _, errors = proc.communicate(timeout=300)
    assert proc.returncode == 0, errors
    expected, _ = WeightStore(straight).load(STEPS)
    actual, _ = WeightStore(stopped).load(STEPS)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


def test_sigterm_while_waiting_for_data_abandons_the_wait_and_checkpoints(tmp_path):
    run = _run(tmp_path / "waiting", 16)  # a few batches of 4 (dynamic sampling drops some)
    proc = _learner_process(tmp_path / "waiting")
    _wait_for(
        lambda: (p := read_learner_progress(run)) is not None and p.step >= 1 and p.waiting,
        "a wait for data after a step",
        proc,
    )
    step = read_learner_progress(run).step
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, errors = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, errors
    assert time.monotonic() - started < 60  # not the stream timeout
    logged = [
        json.loads(line)["step"] for line in (tmp_path / "waiting/metrics/learner.jsonl").open()
    ]
    assert CheckpointStore(run).committed_steps() == [logged[-1]]  # the last step it trained
    assert logged[-1] >= step
