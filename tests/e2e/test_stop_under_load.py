"""A stop from outside on a machine whose every core is busy: SIGTERM to `streamrl run` alone (as
`kill`, a process manager or Prefect's cancellation sends it), to its whole process group, and to
a learner rank (one of torchrun's two) directly. Whichever process got it first, the learner
commits a checkpoint of the last step it finished, every process of the run ends before the
command does, the last line says which step the checkpoint holds, and a resume trains the steps
after it — none twice, none skipped.

Periodic checkpoints are off (`learner.checkpoint_every` beyond the run), so a checkpoint can only
come from the stop. The stop lands once step 2's line is out: on a loaded machine the learner is
in a step or waiting for the groups of the next."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from storage.checkpoints.dcp import CheckpointStore
from storage.fs import open_location
from streamrl.learner.metrics_records import read_metrics
from tests.load import busy_loops

ROOT = Path(__file__).resolve().parents[2]
RUN = [
    "--preset", "grpo", "--preset", "tiny-cpu",
    "generator.max_tokens=16", "learner.batch_groups=2", "learner.mini_batch_groups=2",
    "learner.checkpoint_every=1000", "learner.stop_grace_s=120", "eval.every_versions=0",
    "logging.wandb_mode=disabled",
]  # fmt: skip
STEP = re.compile(r"step (\d+)/\d+:")

pytestmark = pytest.mark.timeout(900)


def _run_processes(run_dir: Path) -> list[str]:
    """The live processes that name `run_dir`: the run's components and their ranks."""
    found = []
    for process in psutil.process_iter(["pid", "cmdline", "status"]):
        with contextlib.suppress(psutil.Error):
            argv = " ".join(process.info["cmdline"] or [])
            ended = process.info["status"] == psutil.STATUS_ZOMBIE
            if str(run_dir) in argv and not ended and process.pid != os.getpid():
                found.append(f"{process.pid}: {argv[:160]}")
    return found


def _learner_ranks(run_dir: Path) -> list[psutil.Process]:
    return [
        p
        for p in psutil.process_iter(["cmdline"])
        if "learner" in (p.info["cmdline"] or [])
        and str(run_dir) in (p.info["cmdline"] or [])
        and "torch.distributed.run" not in (p.info["cmdline"] or [])
    ]


def _stop_after_step_2(run_dir: Path, steps: int, target: str, *extra: str) -> tuple[str, int]:
    """Start the run, wait for step 2's line, send SIGTERM to `target` (parent, group or rank)
    and return the command's output and the last step it showed, once it has exited."""
    argv = [sys.executable, "-m", "streamrl", "run", *RUN, f"storage.run_uri={run_dir}",
            f"learner.total_steps={steps}", *extra]  # fmt: skip
    process = subprocess.Popen(
        argv, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    try:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if (m := STEP.search(line)) and int(m[1]) >= 2:
                break
        else:
            raise AssertionError("".join(lines))
        if target == "parent":
            process.send_signal(signal.SIGTERM)
        elif target == "group":
            os.killpg(process.pid, signal.SIGTERM)
        else:
            os.kill(_learner_ranks(run_dir)[-1].pid, signal.SIGTERM)  # the last rank alone
        lines += process.stdout.readlines()
        assert process.wait(timeout=400) == 130, "".join(lines)
        assert not _run_processes(run_dir), _run_processes(run_dir)  # nothing outlives it
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    output = "".join(lines)
    last = max(int(m[1]) for m in STEP.finditer(output))
    return output, last


def _resume(run_dir: Path, steps: int, *extra: str) -> str:
    argv = [sys.executable, "-m", "streamrl", "run", "--resume", *RUN,
            f"storage.run_uri={run_dir}", f"learner.total_steps={steps}", *extra]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _check_stop_and_resume(run_dir: Path, target: str, *extra: str) -> None:
    with busy_loops():
        output, last = _stop_after_step_2(run_dir, 50, target, *extra)
    saved = CheckpointStore(open_location(str(run_dir))).latest_committed()
    assert saved == last, output  # the stop committed the last step it finished
    assert f"checkpoint at step {last} committed: the run resumes from step {last + 1}" in output
    resumed = _resume(run_dir, last + 2, *extra)
    learner_log = (run_dir / "logs" / "learner.log").read_text()[-3000:]
    assert [int(m[1]) for m in STEP.finditer(resumed)] == [last + 1, last + 2], learner_log
    steps = [m["step"] for m in read_metrics(open_location(str(run_dir)))]
    assert sorted(set(steps)) == list(range(1, last + 3))


def test_sigterm_to_streamrl_run_alone_under_load_keeps_every_finished_step(tmp_path):
    _check_stop_and_resume(tmp_path / "run", "parent")


@pytest.mark.slow
def test_sigterm_to_the_whole_group_under_load_keeps_every_finished_step(tmp_path):
    _check_stop_and_resume(tmp_path / "run", "group")


@pytest.mark.slow
def test_sigterm_to_one_learner_rank_under_load_keeps_every_finished_step(tmp_path):
    """Rank 1 of two (torchrun) gets it alone: it tells rank 0, every rank stops after the
    step in hand and checkpoints together, and the run stops — not restarted."""
    _check_stop_and_resume(tmp_path / "run", "rank", "learner.nproc_per_node=2")
