"""Process lifetimes on Linux: a child that must not outlive its parent.

`die_with_parent(parent_pid, sig)` asks the kernel to send `sig` to the calling process when
its parent dies, however the parent dies (a SIGKILL runs no cleanup). Used by reward workers
(SIGKILL: they hold nothing) and by every process a supervisor starts (SIGTERM: a generator
flushes, a learner's torchrun stops its ranks). The kernel sends the signal when the *thread*
that started the child ends, so a supervisor starts each child from a thread that lives as long
as the child. Elsewhere than on Linux: a no-op.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["die_with_parent"]

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
