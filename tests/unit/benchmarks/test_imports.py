"""Every benchmark imports: a module renamed or moved in the package must not leave a benchmark
that fails only when someone runs it for figures."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
BENCHMARKS = sorted(m.name for m in pkgutil.iter_modules([str(ROOT / "benchmarks")]))


def test_every_benchmark_imports() -> None:
    assert {"learner_bench", "fleet_bench"} <= set(BENCHMARKS)
    code = "import importlib\n" + "".join(
        f"importlib.import_module('benchmarks.{name}')\n" for name in BENCHMARKS
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
