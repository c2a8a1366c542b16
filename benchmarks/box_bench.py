"""The cost of the box for model-written code (`streamrl.isolation.box`) per call, against
starting the same program bare (`python -I main.py`, no box), and calls per second with several
calls at once (a code-RL generator runs up to `workers` in parallel).

    .venv/bin/python -m benchmarks.box_bench [--calls 200] [--workers 1 2]

Programs: `empty` (the interpreter's start alone: the box's whole overhead shows) and `tests`
(a typical solution run against its tests: sorts and checks 20 lists of 5000 numbers). Prints
median and p95 latency of each, the boxed/bare ratio, and calls/s with 1..N calls at once; every
ratio compares two figures from the same run.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.storage_bench import markdown_table
from streamrl.isolation.box import BoxLimits, box_mode, check_box, run_in_box

PROGRAMS = {
    "empty": "",
    "tests": (
        "import random\n"
        "rng = random.Random(0)\n"
        "for _ in range(20):\n"
        "    xs = [rng.randint(-10**6, 10**6) for _ in range(5000)]\n"
        "    assert sorted(xs) == sorted(xs, key=lambda x: x)\n"
        "print('passed')\n"
    ),
}
LIMITS = BoxLimits(wall_s=30.0, memory_mb=1024)


def boxed(source: str) -> Callable[[], None]:
    files = {"main.py": source.encode()}

    def call() -> None:
        result = run_in_box(["python", "/box/main.py"], limits=LIMITS, files=files)
        assert result.returncode == 0, result.stderr

    return call


def bare(source: str, folder: Path) -> Callable[[], None]:
    path = folder / f"main-{abs(hash(source))}.py"
    path.write_text(source)

    def call() -> None:
        subprocess.run([sys.executable, "-I", str(path)], check=True, capture_output=True)

    return call


def latencies(call: Callable[[], None], calls: int) -> list[float]:
    call()  # warm the page cache
    seconds = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    return seconds


def throughput(call: Callable[[], None], calls: int, workers: int) -> float:
    started = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        for future in [pool.submit(call) for _ in range(calls)]:
            future.result()
    return calls / (time.perf_counter() - started)


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per measurement (≥ 200)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    check_box()
    print(f"box: {box_mode()}; {args.calls} calls per figure; python {sys.version.split()[0]}")
    with tempfile.TemporaryDirectory() as folder:
        runs = {
            name: (bare(source, Path(folder)), boxed(source)) for name, source in PROGRAMS.items()
        }
        rows = []
        for name, (bare_call, boxed_call) in runs.items():
            plain, box = latencies(bare_call, args.calls), latencies(boxed_call, args.calls)
            rows.append(
                {
                    "program": name,
                    "bare_median_ms": statistics.median(plain) * 1e3,
                    "bare_p95_ms": p95(plain) * 1e3,
                    "boxed_median_ms": statistics.median(box) * 1e3,
                    "boxed_p95_ms": p95(box) * 1e3,
                    "median_ratio": statistics.median(box) / statistics.median(plain),
                    "p95_ratio": p95(box) / p95(plain),
                }
            )
        print("## Latency per call: boxed vs bare")
        print(markdown_table(rows))
        rows = []
        for name, (bare_call, boxed_call) in runs.items():
            for workers in args.workers:
                plain = throughput(bare_call, args.calls, workers)
                box = throughput(boxed_call, args.calls, workers)
                rows.append(
                    {
                        "program": name,
                        "workers": workers,
                        "bare_calls_s": plain,
                        "boxed_calls_s": box,
                        "boxed_vs_bare": box / plain,
                    }
                )
        print("## Calls per second, calls in parallel")
        print(markdown_table(rows))


if __name__ == "__main__":
    main()
