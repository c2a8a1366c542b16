"""`streamrl run --preset sft`: a supervised run of the tiny model — the learner alone (no
generator, no evaluator), one line per step with its loss, the held-out loss, a summary and
`streamrl status` that speak of the loss, and weights a later stage can start from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _streamrl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "streamrl", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )


def _conversations(path: Path, numbers: range) -> None:
    rows = [
        {"messages": [
            {"role": "user", "content": f"What is {i} + {2 * i}?"},
            {"role": "assistant", "content": f"{i} + {2 * i} = {3 * i}."},
        ]}
        for i in numbers
    ]  # fmt: skip
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.mark.timeout(600)
def test_a_supervised_run_trains_the_learner_alone_and_reports_its_loss(tmp_path):
    _conversations(tmp_path / "train.jsonl", range(12))
    _conversations(tmp_path / "val.jsonl", range(40, 44))
    run_dir = tmp_path / "run"
    done = _streamrl(
        "run", "--preset", "sft", "--preset", "tiny-cpu", f"storage.run_uri={run_dir}",
        f"data.path={tmp_path / 'train.jsonl'}", f"data.val_path={tmp_path / 'val.jsonl'}",
        "learner.total_steps=3", "learner.batch_groups=4", "learner.mini_batch_groups=4",
        "learner.lr=1e-3", "learner.warmup_steps=0", "sft.eval_every=3",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    assert "learner + 0 generator(s) (supervised)" in done.stdout
    steps = [line for line in done.stdout.splitlines() if line.startswith("[learner] step ")]
    assert [s.split(":")[0] for s in steps] == [f"[learner] step {i}/3" for i in (1, 2, 3)]
    assert "held-out" in steps[2]
    assert "held-out" not in steps[0]
    assert "loss:" in done.stdout
    assert "held-out:" in done.stdout
    assert "reward:" not in done.stdout
    assert sorted(p.name for p in (run_dir / "logs").glob("*.log")) == ["learner.log"]
    assert not (run_dir / "stream").exists() or not any((run_dir / "stream").rglob("*.json"))
    status = _streamrl("status", str(run_dir))
    assert status.returncode == 0, status.stderr
    assert "(sft, model tiny-qwen2" in status.stdout
    assert "held-out loss" in status.stdout
    assert "generators" not in status.stdout
    # Its last version is an ordinary one: exported, it is a model directory.
    exported = _streamrl("export", str(run_dir), "--out", str(tmp_path / "model"))
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert (tmp_path / "model" / "config.json").exists()


def test_generators_asked_of_a_supervised_run_are_refused(tmp_path):
    done = _streamrl(
        "run", "--preset", "sft", "--preset", "tiny-cpu", "--generators", "2",
        f"storage.run_uri={tmp_path / 'run'}",
    )  # fmt: skip
    assert done.returncode != 0
    assert "a supervised run (sft set)" in done.stderr
    assert not (tmp_path / "run").exists()
