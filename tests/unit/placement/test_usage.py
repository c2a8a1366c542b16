"""CPU time of a process tree (`streamrl.placement.usage`): a child's work counts while it runs,
and a meter's laps split the time between them."""

from __future__ import annotations

import subprocess
import sys
import time

from streamrl.placement.usage import CpuMeter, tree_cpu_s

BUSY_CHILD = (
    "import time\nend = time.process_time() + 0.6\n"
    "while time.process_time() < end: pass\ntime.sleep(60)"
)


def test_a_live_childs_cpu_counts_in_the_tree():
    before = tree_cpu_s()
    child = subprocess.Popen([sys.executable, "-c", BUSY_CHILD])
    try:
        deadline = time.monotonic() + 60
        while tree_cpu_s() - before < 0.6:  # the child's 0.6 s and its interpreter's start
            assert child.poll() is None
            assert time.monotonic() < deadline, "the child's CPU time never showed"
            time.sleep(0.1)
    finally:
        child.kill()
        child.wait()


def test_a_meters_laps_measure_the_work_between_them():
    meter = CpuMeter()
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    used, share = meter.lap()
    assert used >= 0.3 - 0.02  # psutil reads the kernel's clock ticks (10 ms), not process_time
    assert 0 < share <= 1.0
    time.sleep(0.3)
    idle, _ = meter.lap()
    assert idle < 0.1  # asleep: the next lap holds only what came after the first
