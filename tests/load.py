"""A loaded machine for tests that must hold under contention: `busy_loops(n)` keeps `n`
spinning processes (default: one per core this process may use) for as long as its block lasts."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def busy_loops(count: int | None = None) -> Iterator[None]:
    """`count` busy loops (default: one per usable core), killed and reaped at the end."""
    count = len(os.sched_getaffinity(0)) if count is None else count
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
