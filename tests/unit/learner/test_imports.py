"""The learner side imports only what a GPU machine without vLLM carries.

A GPU box for the learner has PyTorch, transformers and the storage stack, and nothing of the
generators' or the flows' world; `scripts/device_wheels.sh` carries the rest. So the learner's
loop (`python -m streamrl learner`), `storage/` and the GPU check (`benchmarks/gpu_check.py`,
its benchmarks and `tests/gpu`) must import neither vLLM nor Prefect, wandb (the reporter
imports it only when it is enabled), s3fs (fsspec imports it for s3:// only) nor math-verify.
Each check runs in a fresh interpreter in which importing any of them fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ABSENT = ("vllm", "prefect", "wandb", "s3fs", "aiobotocore", "math_verify")
LEARNER_MODULES = (
    "streamrl.learner",
    "streamrl.learner.loop",
    "streamrl.learner.topology",
    "streamrl.placement",  # run_learner imports these two when it runs
    "streamrl.config.stored",
    "benchmarks.learner_bench",
    "benchmarks.learner_measures",
    "benchmarks.attention_bench",  # the GPU check's parts (benchmarks.gpu_check)
    "benchmarks.gpu_check",
    "tests.gpu.test_learner_cuda",
)

# Installed first in the child: a finder that refuses the absent packages.
BLOCKER = f"""
import sys
ABSENT = {ABSENT!r}

class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            raise ImportError(f"{{name}} is not installed on the learner's machine")
        return None

sys.meta_path.insert(0, Absent())

# A probe such as `importlib.util.find_spec("wandb")` (accelerate's, which transformers imports
# when it is installed) answers None for a package that is not installed, as it would there.
import importlib.util
_find_spec = importlib.util.find_spec

def find_spec(name, package=None):
    if name.split(".")[0] in ABSENT:
        return None
    return _find_spec(name, package)

importlib.util.find_spec = find_spec
"""


def run_without_absent(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCKER + code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_learner_storage_and_benchmark_import_without_vllm_prefect_or_wandb():
    code = f"""
import importlib, json, pkgutil
import storage
modules = list({LEARNER_MODULES!r})
modules += [m.name for m in pkgutil.walk_packages(storage.__path__, "storage.")]
for name in modules:
    importlib.import_module(name)
print(json.dumps(sorted(modules)))
"""
    result = run_without_absent(code)
    assert result.returncode == 0, result.stderr[-3000:]
    imported = json.loads(result.stdout.strip().splitlines()[-1])
    expected = {"storage.stream.segments", "storage.stream.writer", "storage.weights.versions"}
    assert expected <= set(imported)


def test_learner_and_benchmark_command_lines_start_without_vllm_prefect_or_wandb():
    code = """
import runpy, sys
for argv in (["streamrl", "learner", "--help"], ["learner_bench", "--help"]):
    sys.argv = argv
    module = "streamrl" if argv[0] == "streamrl" else "benchmarks.learner_bench"
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit:
        assert exit.code in (0, None), (argv, exit.code)
"""
    result = run_without_absent(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--run RUN_URI" in result.stdout  # streamrl learner --help
    assert "--device {cpu,cuda}" in result.stdout  # learner_bench --help
