"""What a process of the run has used of the cores it was placed on: the CPU seconds of it, its
threads and every process under it (a generator's engine core and reward workers, a learner's
helpers), for the utilisation figures of a placement (`perf/learner_cpu_s`,
`generators/cpu_s_total`).

`tree_cpu_s()` is cumulative over this process's life: live descendants count with their CPU
time so far, ended ones once their parent has waited for them (the kernel adds them to the
parent's children times then), and a descendant that ended unwaited is not counted.
"""

from __future__ import annotations

import os
import time

import psutil

__all__ = ["CpuMeter", "tree_cpu_s"]


def tree_cpu_s() -> float:
    """CPU seconds (user + system) used so far by this process and every process under it."""
    me = psutil.Process()
    times = me.cpu_times()
    total = times.user + times.system + times.children_user + times.children_system
    for child in me.children(recursive=True):
        try:
            child_times = child.cpu_times()
        except psutil.Error:  # ended meanwhile: counted in its parent's children times, if waited
            continue
        total += child_times.user + child_times.system
    return total


class CpuMeter:
    """The CPU this process tree used between calls of `lap()`, and its share of the time of
    the cores this process may run on."""

    def __init__(self) -> None:
        self._at, self._cpu = time.monotonic(), tree_cpu_s()

    def lap(self) -> tuple[float, float]:
        """(CPU seconds since the previous lap, those over wall seconds × cores)."""
        now, cpu = time.monotonic(), tree_cpu_s()
        used, wall = cpu - self._cpu, now - self._at
        self._at, self._cpu = now, cpu
        return used, used / max(wall * len(os.sched_getaffinity(0)), 1e-9)
