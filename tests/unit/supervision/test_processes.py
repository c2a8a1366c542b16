"""Every process of a component ends with it (`streamrl.supervision.processes.ProcessTree`, used by
`run_process`): a process in a session of its own (as torchrun starts each rank) gets the stop
signal itself, and whatever is left once the first process exits is killed and waited for."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import psutil

from streamrl.supervision.launch import run_process

# A launcher like torchrun: it starts a "rank" in a session of its own, then, stopped, exits at
# once without passing the signal on. The rank takes a second to write down the SIGTERM it got
# (a checkpoint's commit), within the stop's grace, then runs on.
LAUNCHER = """
import subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], start_new_session=True)
print(rank.pid, flush=True)
time.sleep(300)
"""
RANK = """
import pathlib, signal, sys, time
def stopped(*_):
    time.sleep(1)
    pathlib.Path(sys.argv[1]).write_text("SIGTERM")
signal.signal(signal.SIGTERM, stopped)
print("rank ready", flush=True)
while True:
    time.sleep(0.1)
"""


def test_a_rank_in_a_session_of_its_own_is_stopped_and_does_not_outlive_its_launcher(tmp_path):
    got = tmp_path / "got"
    lines: list[str] = []
    stop = threading.Event()
    argv = [sys.executable, "-c", LAUNCHER, RANK, str(got)]
    result: list[int] = []
    runner = threading.Thread(
        target=lambda: result.append(run_process(argv, lines.append, stop, grace_s=5.0))
    )
    runner.start()
    deadline = time.monotonic() + 60
    while "rank ready" not in lines and time.monotonic() < deadline:
        time.sleep(0.1)
    rank = psutil.Process(int(next(line for line in lines if line.isdigit())))
    time.sleep(3)  # the supervisor has looked its processes up (every 2 s)
    stop.set()
    runner.join(timeout=60)
    assert not runner.is_alive()
    assert got.read_text() == "SIGTERM"  # the rank itself was told to stop, and had its grace
    assert not rank.is_running() or rank.status() == psutil.STATUS_ZOMBIE  # and it was ended
    assert result == [-15]


def test_what_a_component_leaves_behind_when_it_exits_is_ended(tmp_path: Path):
    """A component that exits, leaving a process of another session (its pid printed)."""
    leaver = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], "
        "start_new_session=True); print(p.pid, flush=True); time.sleep(3)"
    )
    lines: list[str] = []
    assert run_process([sys.executable, "-c", leaver], lines.append) == 0
    left = psutil.Process(int(lines[0])) if psutil.pid_exists(int(lines[0])) else None
    assert left is None or left.status() == psutil.STATUS_ZOMBIE
