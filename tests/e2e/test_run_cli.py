"""`streamrl run`: a whole run without a Prefect server, then resumed with a larger budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "generator.max_tokens=16",
    "learner.batch_groups=2",
    "learner.mini_batch_groups=2",
    "learner.checkpoint_every=2",
    "algorithm.dynamic_sampling=false",
]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "streamrl",
            "run",
            "--preset",
            "dapo",
            "--preset",
            "tiny-cpu",
            *args,
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.timeout(900)
def test_streamrl_run_trains_to_its_budget_then_resumes_to_a_larger_one(tmp_path):
    run_dir = tmp_path / "run"
    first = _run(f"storage.run_uri={run_dir}", "learner.total_steps=2", *TINY)
    assert first.returncode == 0, first.stderr[-3000:] + first.stdout[-3000:]
    assert "accuracy:" in first.stdout
    assert (run_dir / "logs" / "learner.log").exists()
    assert (run_dir / "logs" / "gen0.log").exists()

    again = _run(f"storage.run_uri={run_dir}", "learner.total_steps=2", *TINY)
    assert again.returncode == 2
    assert "already exists" in again.stderr  # never overwrites a run

    resumed = _run("--resume", f"storage.run_uri={run_dir}", "learner.total_steps=4", *TINY)
    assert resumed.returncode == 0, resumed.stderr[-3000:] + resumed.stdout[-3000:]
    steps = [
        json.loads(x)["step"]
        for x in (run_dir / "metrics" / "learner.jsonl").read_text().splitlines()
    ]
    assert steps == [1, 2, 3, 4]  # continued from the checkpoint at step 2
