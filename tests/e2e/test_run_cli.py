"""`streamrl run`: a whole run without a Prefect server, then resumed with a larger budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from storage.fs import open_location
from streamrl.placement.handoff import handoff_dir
from streamrl.supervision.output import RESTART_NOTICE
from streamrl.supervision.policy import NOT_RESTARTED

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
    # The first life hands weights to the generator through memory (storage still written;
    # whether the generator loads a version before the learner's last step depends on timing).
    first = _run(f"storage.run_uri={run_dir}", "learner.total_steps=2", "weights.handoff=true",
                 *TINY)  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:] + first.stdout[-3000:]
    assert "accuracy:" in first.stdout
    assert "weight versions go from the learner to gen0 from its host memory" in first.stdout
    assert (run_dir / "logs" / "learner.log").exists()
    assert not handoff_dir(open_location(str(run_dir)).uri).exists()  # removed at the end

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


def test_a_misspelt_reward_module_stops_the_run_within_seconds_naming_the_fix(tmp_path):
    """A module not found at all is refused before anything starts. One in a package that is
    there (only importing the package could tell) fails the generator before vLLM starts, with
    exit code 4: the run stops at once with the generator's error line, without restarting it
    --max-restarts times to print the same error."""
    run_dir = tmp_path / "run"
    started = time.monotonic()
    refused = _run(f"storage.run_uri={run_dir}", "generator.reward.fn=tsets.reward_fns:scripted")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "generator.reward.fn: no module named 'tsets'" in refused.stderr
    assert "check the spelling" in refused.stderr
    assert not run_dir.exists()  # nothing started

    misspelt = "tests.reward_fnz:scripted"
    stopped = _run(f"storage.run_uri={run_dir}", f"generator.reward.fn={misspelt}", *TINY)
    assert stopped.returncode == 1, stopped.stderr[-3000:] + stopped.stdout[-3000:]
    assert f"gen0 cannot run (exit code 4: reward '{misspelt}': no module named" in stopped.stderr
    assert "check the spelling" in stopped.stderr
    assert NOT_RESTARTED in stopped.stderr
    assert RESTART_NOTICE not in stopped.stdout
    assert (run_dir / "logs" / "gen0.log").read_text().count("no module named") == 1  # one start
    assert time.monotonic() - started < 60  # three restarts took ~35 s on their own
