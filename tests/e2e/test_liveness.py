"""A hung generator is noticed and replaced: SIGSTOP to a real generator of a `streamrl run` (it
neither exits nor fails, it only stops beating its heartbeat). Past `placement.liveness_timeout_s`
the supervisor ends it — the reason on the terminal — and restarts it, and the run finishes."""

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

ROOT = Path(__file__).resolve().parents[2]
STEP = re.compile(r"step (\d+)/\d+:")

pytestmark = pytest.mark.timeout(900)


def _generator(run_dir: Path) -> psutil.Process:
    for process in psutil.process_iter(["cmdline"]):
        argv = process.info["cmdline"] or []
        if "generator" in argv and str(run_dir) in argv:
            return process
    raise AssertionError("no generator process")


def test_a_stopped_generator_is_ended_restarted_and_the_run_finishes(tmp_path):
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "streamrl", "run", "--preset", "grpo", "--preset", "tiny-cpu",
            "generator.max_tokens=16", "learner.batch_groups=2", "learner.mini_batch_groups=2",
            "eval.every_versions=0", "logging.wandb_mode=disabled", "learner.total_steps=12",
            "placement.liveness_timeout_s=20", f"storage.run_uri={run_dir}"]  # fmt: skip
    process = subprocess.Popen(
        argv, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    try:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if STEP.search(line):
                break
        stopped = _generator(run_dir)
        stopped.suspend()  # SIGSTOP: alive, silent
        lines += process.stdout.readlines()
        assert process.wait(timeout=600) == 0, "".join(lines)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(psutil.Error):
            stopped.kill()
    output = "".join(lines)
    assert "gen0 is hung, no heartbeat for" in output, output
    assert re.search(r"exited with code -?\d+ \(hung: no heartbeat for \d+ s", output), output
    assert max(int(m[1]) for m in STEP.finditer(output)) == 12
    assert not stopped.is_running() or stopped.status() == psutil.STATUS_ZOMBIE
