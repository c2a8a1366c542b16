"""Every process of a component, however it was started: `ProcessTree`.

A supervisor starts each component in a session of its own and signals that process group. Not
every process a component starts stays in it: torchrun starts each learner rank in a session of
its own (so does a scorer's vLLM server, and a box's init), and a process whose parent died is
re-parented out of the tree, where nothing finds it by walking down from the component.

`ProcessTree(pid)` remembers every descendant of the component's first process it has seen
(`refresh`, called while the component runs), each identified by pid *and* start time, so a pid
the system has since reused is never signalled. On a stop, `terminate` sends SIGTERM to the
group and to each remembered process outside it: a learner rank gets the signal itself, whichever
launcher started it, and stops with its checkpoint (`streamrl.learner`). Once the first process
has exited, `end_leftovers` kills whatever of the tree is still alive and waits for it: nothing a
component started outlives it. Linux only (elsewhere the tree is the first process alone).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import psutil

__all__ = ["ProcessTree"]


class ProcessTree:
    """The processes of one component: its first process (`root`, the leader of its own
    process group) and every descendant seen by `refresh`."""

    def __init__(self, root: int) -> None:
        self.root = root
        self._known: dict[int, psutil.Process] = {}
        self._lock = threading.Lock()  # the stop watcher's thread refreshes, the caller's ends

    def refresh(self) -> None:
        """Remember the root's descendants as they are now (those already remembered stay,
        even once re-parented elsewhere)."""
        try:
            children = psutil.Process(self.root).children(recursive=True)
        except psutil.Error:  # the root has exited: what it left is already remembered
            return
        with self._lock:
            for child in children:
                self._known.setdefault(child.pid, child)

    def alive(self) -> list[psutil.Process]:
        """The remembered descendants still running (a zombie has ended)."""
        running = []
        with self._lock:
            known = list(self._known.values())
        for process in known:
            with contextlib.suppress(psutil.Error):
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    running.append(process)
        return running

    def terminate(self, sig: int = signal.SIGTERM) -> None:
        """`sig` to the root's process group and to every live descendant outside it."""
        self.refresh()
        _signal_group(self.root, sig)
        for process in self.alive():
            with contextlib.suppress(psutil.Error, OSError):
                if os.getpgid(process.pid) != self.root:
                    process.send_signal(sig)  # checks the start time: never a reused pid

    def wait_ended(self, timeout_s: float) -> None:
        """Until every remembered descendant has ended, or for `timeout_s` at most."""
        deadline = time.monotonic() + timeout_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.1)

    def end_leftovers(self, wait_s: float = 10.0) -> list[str]:
        """After the root exited: SIGKILL to its group and to every live descendant, then wait
        up to `wait_s` for them. Returns those still alive ("pid: command"), if any."""
        _signal_group(self.root, signal.SIGKILL)
        left = self.alive()
        for process in left:
            with contextlib.suppress(psutil.Error):
                process.kill()
        _, still = psutil.wait_procs(left, timeout=wait_s)
        return [_describe(p) for p in still if p in self.alive()]


def _signal_group(leader: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, sig)


def _describe(process: psutil.Process) -> str:
    try:
        return f"{process.pid}: {' '.join(process.cmdline())[:200]}"
    except psutil.Error:
        return str(process.pid)
