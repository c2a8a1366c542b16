"""`streamrl run --preset dpo`: a preference run of the tiny model on the bundled pairs — the
learner alone, one line per step with its loss, margin and pair accuracy, held-out pair metrics,
a summary and `streamrl status` that speak of them — and a resumed run that trains exactly as
one that never stopped."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from storage.fs import open_location
from storage.stream.writer import StreamWriter
from storage.weights.versions import WeightStore
from tests.stream_data import random_group

ROOT = Path(__file__).resolve().parents[2]
PAIRS = [
    "data.path=builtin:arithmetic-pairs",
    "data.val_path=builtin:arithmetic-pairs-test",
    "preference.eval_pairs=8",
    "preference.eval_every=2",
    "learner.batch_groups=4",
    "learner.mini_batch_groups=2",  # two updates a step
    "learner.lr=1e-4",
    "learner.checkpoint_every=2",
    "preference.reference=cached",
]


def _streamrl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "streamrl", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )


def _run(run_dir: Path, steps: int, *extra: str, resume: bool = False):
    return _streamrl(
        "run", *(["--resume"] if resume else []), "--preset", "dpo", "--preset", "tiny-cpu",
        f"storage.run_uri={run_dir}", f"learner.total_steps={steps}", *PAIRS, *extra,
    )  # fmt: skip


def _metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics" / "learner.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _log(run_dir: Path) -> str:
    return (run_dir / "logs" / "learner.log").read_text()


def _last_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    tensors, _ = WeightStore(open_location(str(run_dir))).load()
    return tensors


@pytest.mark.timeout(900)
def test_a_dpo_run_learns_its_pairs_reports_them_and_resumes_exactly(tmp_path):
    straight = tmp_path / "straight"
    done = _run(straight, 4)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    assert "learner + 0 generator(s) (preference)" in done.stdout
    steps = [line for line in done.stdout.splitlines() if line.startswith("[learner] step ")]
    assert [s.split(":")[0] for s in steps] == [f"[learner] step {i}/4" for i in (1, 2, 3, 4)]
    assert all(" margin " in s and " acc " in s for s in steps)
    assert "held-out acc" in steps[1]
    assert "held-out acc" not in steps[0]
    assert "pair acc:" in done.stdout  # the summary
    assert "reward:" not in done.stdout
    # The held-out pairs under the weights the run started from, before step 1 trained: the
    # policy is its reference (every margin 0, no pair won), its own preference is measured.
    first, *rest = _metrics(straight)
    assert first["initial/pref/eval_accuracy"] == 0.0
    assert first["initial/pref/eval_margin"] == 0.0
    assert 0.0 < first["initial/pref/eval_likelihood_accuracy"] < 1.0
    assert not any(key.startswith("initial/") for m in rest for key in m)
    assert "held-out:  0.0000 (step 0) → " in done.stdout
    likelihood = first["initial/pref/eval_likelihood_accuracy"]
    assert f"likelihood: {likelihood:.4f} (step 0) → " in done.stdout
    assert sorted(p.name for p in (straight / "logs").glob("*.log")) == ["learner.log"]
    status = _streamrl("status", str(straight))
    assert "pref loss" in status.stdout
    assert "held-out pref acc" in status.stdout

    # The reference scored every pair once, before step 1 (preference.reference: cached).
    assert (straight / "preference" / "reference.json").exists()
    assert "reference log-probs of 1534 pairs scored and stored" in _log(straight)

    # Stopped after 2 steps (a checkpoint), resumed to 4: the same weights, bit for bit; the
    # resumed life reads the reference's log-probs back instead of scoring them again.
    halves = tmp_path / "halves"
    first = _run(halves, 2)
    assert first.returncode == 0, first.stderr[-3000:] + first.stdout[-3000:]
    second = _run(halves, 4, resume=True)
    assert second.returncode == 0, second.stderr[-3000:] + second.stdout[-3000:]
    assert "reference log-probs of 1534 pairs read from" in _log(halves)
    assert [any(k.startswith("initial/") for k in m) for m in _metrics(halves)] == [
        True,
        False,
        False,
        False,
    ]  # the resumed life started from step 2's weights: nothing of its own to record
    one, other = _last_weights(straight), _last_weights(halves)
    assert one.keys() == other.keys()
    for name in one:
        assert torch.equal(one[name], other[name]), name

    # The reference scored beside the policy each step instead: the same losses, to rounding.
    live = tmp_path / "on-the-fly"
    done = _run(live, 2, "preference.reference=on_the_fly")
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    assert not (live / "preference").exists()
    cached, scored = _metrics(straight)[:2], _metrics(live)
    # π = π_ref at the first update (the step's second update has moved the policy a little)
    assert cached[0]["pref/loss"] == pytest.approx(math.log(2), abs=0.01)
    for a, b in zip(cached, scored, strict=True):
        assert b["pref/loss"] == pytest.approx(a["pref/loss"], abs=1e-4)
        assert b["pref/margin"] == pytest.approx(a["pref/margin"], abs=1e-4)


def test_a_run_cannot_be_both_supervised_and_preference(tmp_path):
    done = _run(tmp_path / "run", 2, "sft.eval_every=1")
    assert done.returncode == 2
    assert "sft and preference are both set" in done.stderr


def test_pairs_from_a_runs_stream_train_a_preference_run(tmp_path):
    """`preference.pairs_from`: the groups another run committed become this run's pairs."""
    source = open_location(str(tmp_path / "rl"))
    source.fs.makedirs(source.path, exist_ok=True)
    rng = np.random.default_rng(0)
    for segment in range(3):
        groups = [random_group(rng, prompt_id=f"p{segment}-{i}", vocab=200, max_len=12)
                  for i in range(8)]  # fmt: skip
        StreamWriter(source, "gen0").write(groups)
    run_dir = tmp_path / "dpo"
    done = _streamrl(
        "run", "--preset", "dpo", "--preset", "tiny-cpu", f"storage.run_uri={run_dir}",
        f"preference.pairs_from={tmp_path / 'rl'}", "data.val_path=null",
        "learner.total_steps=2", "learner.batch_groups=4", "learner.mini_batch_groups=4",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    log = _log(run_dir)
    assert re.search(r"pairs from the stream of \S+: \d+ of 24 groups", log)
    assert (run_dir / "preference" / "pairs_from.json").exists()
    assert [m["pref/pairs"] for m in _metrics(run_dir)] == [4.0, 4.0]


def test_a_lora_dpo_run_takes_the_base_as_its_reference(tmp_path):
    """With adapters the reference is the frozen base (adapters switched off): the first
    update's loss is log 2 (policy = reference), and versions are the adapter alone."""
    run_dir = tmp_path / "lora"
    done = _run(run_dir, 2, "model.lora.rank=8", "preference.reference=on_the_fly",
                "learner.mini_batch_groups=4")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    first = _metrics(run_dir)[0]
    assert first["pref/loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert first["pref/margin"] == pytest.approx(0.0, abs=1e-4)
    names = list(_last_weights(run_dir))
    assert names
    assert all("lora" in name for name in names), names[:3]


def test_cached_references_keep_training_and_held_out_pairs_apart(tmp_path):
    """A held-out file named as the training file (both `pairs.jsonl`) gives pair ids that
    collide; the cache keys them by split, so every pair keeps its own reference."""
    for split, numbers in (("train", range(8)), ("val", range(50, 58))):
        (tmp_path / split).mkdir()
        rows = [
            {"prompt": f"What is {i} + {2 * i}?", "chosen": f"{3 * i}.",
             "rejected": f"{3 * i + 1}, I think, after a long and winding computation."}
            for i in numbers
        ]  # fmt: skip
        (tmp_path / split / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    done = _streamrl(
        "run", "--preset", "dpo", "--preset", "tiny-cpu", f"storage.run_uri={run_dir}",
        f"data.path={tmp_path / 'train' / 'pairs.jsonl'}",
        f"data.val_path={tmp_path / 'val' / 'pairs.jsonl'}", "preference.reference=cached",
        "preference.eval_every=1", "learner.total_steps=1", "learner.batch_groups=8",
        "learner.mini_batch_groups=8",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    (step,) = _metrics(run_dir)
    assert step["pref/loss"] == pytest.approx(math.log(2), abs=1e-3)  # π = π_ref, every pair
    assert step["pref/margin"] == pytest.approx(0.0, abs=1e-3)
    # The policy's own preference (no reference), on the step's and the held-out pairs.
    for key in ("pref/likelihood_accuracy", "pref/eval_likelihood_accuracy"):
        assert step[key] in {k / 8 for k in range(9)}, key  # a fraction of the 8 pairs
