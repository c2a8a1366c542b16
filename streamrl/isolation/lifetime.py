"""Process lifetimes: a child that must not outlive its parent, and a process that stops on
SIGTERM.

`die_with_parent(parent_pid, sig)` asks the kernel to send `sig` to the calling process when
its parent dies, however the parent dies (a SIGKILL runs no cleanup). Used by reward workers
(SIGKILL: they hold nothing). `dying_with_parent(argv, ...)` is the same for a program a
supervisor starts (SIGTERM: a generator flushes, a learner's torchrun stops its ranks): `argv`
behind a small exec wrapper that sets the signal, the planned cores and CPU priority, and then
execs it.

CPU priority: a `background` program runs at nice 19, so that next to a program at nice 0 it
gets about 1.5 % of a core they both want (kernel weights 15 against 1024) and every cycle the
other leaves. Not Linux's SCHED_IDLE: that would leave it nothing at all while anything else
runs, and the work of a generator's reward and environment workers runs under wall-clock
limits. Where the kernel schedules each session as one group (autogroup), nice ranks a program
only against the others of its session: a supervisor starts the run's programs in its own
session (their own process groups), so that a background one yields to the run's learner, not
to every other program of the machine.
A `preexec_fn` would run Python between fork and exec in a child of a threaded parent, which
can crash on state the parent's other threads left mid-change; the wrapper is a fresh
interpreter. The kernel sends the signal when the *thread* that started the child ends, so a
supervisor starts each child from a thread that lives as long as the child. Elsewhere than on
Linux: a no-op.

`stop_on_sigterm()` is the stop event every process of a run watches (learner, generator,
evaluator): SIGTERM or Ctrl-C sets it, and the process finishes its work in hand.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

__all__ = ["BACKGROUND_NICE", "die_with_parent", "dying_with_parent", "stop_on_sigterm"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Loaded once, before any fork: the call in a freshly forked child then only enters libc.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Have Linux send `sig` to this process when its parent dies. A parent that died before
    this call (this process was already re-parented) ends this process at once."""
    if _LIBC is None:
        return
    if _LIBC.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(1)


BACKGROUND_NICE = 19

# Runs in the child: the parent-death signal (checked against a parent that died first), the
# cores, the priority, then the program. Arguments: parent pid, signal, comma-separated cores,
# the background nice value or "", argv.
_WRAPPER = """
import ctypes, os, sys
parent, sig, cores, background = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
if ctypes.CDLL(None, use_errno=True).prctl(1, sig, 0, 0, 0) != 0:
    sys.exit(f"prctl(PR_SET_PDEATHSIG) failed: errno {ctypes.get_errno()}")
if os.getppid() != parent:
    os._exit(1)
if cores:
    os.sched_setaffinity(0, [int(c) for c in cores.split(",")])
if background:
    os.setpriority(os.PRIO_PROCESS, 0, int(background))
try:
    os.execvp(sys.argv[5], sys.argv[5:])
except OSError as error:
    sys.exit(f"cannot run {sys.argv[5]}: {error.strerror}")
"""


def dying_with_parent(
    argv: list[str],
    parent_pid: int,
    sig: int = signal.SIGTERM,
    cpus: tuple[int, ...] = (),
    *,
    background: bool = False,
) -> list[str]:
    """`argv` behind the exec wrapper (module docstring): it gets `sig` when `parent_pid` (the
    thread of it that starts the child) dies, runs on `cpus` (all when empty) and, when
    `background`, only on what other programs leave."""
    if _LIBC is None:
        return list(argv)
    cores = ",".join(str(c) for c in cpus)
    return [
        sys.executable,
        "-I",
        "-S",
        "-c",
        _WRAPPER,
        str(parent_pid),
        str(int(sig)),
        cores,
        str(BACKGROUND_NICE) if background else "",
        *argv,
    ]


def stop_on_sigterm(stop: threading.Event | None = None) -> threading.Event:
    """`stop`, or a new event, set by SIGTERM or SIGINT (Ctrl-C) when called from the main
    thread: a process that watches it finishes its work in hand, releases what it holds (its
    lease) and exits 0. A second Ctrl-C interrupts at once."""
    stop = stop or threading.Event()

    def stopping(signum: int, frame: object) -> None:
        stop.set()
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stopping)
        signal.signal(signal.SIGINT, stopping)
    return stop
