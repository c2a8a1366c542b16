"""A learner's arithmetic does not depend on machine load: the same run trained on an idle
machine and on one where two busy processes compete for its cores ends with bit-identical fp32
checkpoints (parameters and optimiser state), not only published versions.

What load changes is when the learner's threads run. The upload thread that a publish starts
switches its own intra-op threads to one (`torch.set_num_threads`), which also turns MKL's
dynamic thread count off for the whole process; the CPU flash-attention backward calls MKL from
inside OpenMP regions, and its result depends on that flag. So the training step's arithmetic
changed at whatever moment a starved upload thread got the CPU. The contended run here also
starts that thread late (as a loaded machine can), which makes the race land after a training
step every time instead of only on some loaded machines.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from storage.checkpoints.dcp import CheckpointStore
from storage.control.manifest import create_run
from storage.fs import open_location
from storage.stream.writer import StreamWriter
from streamrl.config.loading import load_config
from tests.load import busy_loops
from tests.stream_data import random_group

ROOT = Path(__file__).resolve().parents[3]
STEPS = 12

# The learner, its first upload thread started `delay` seconds late (argv: run, delay).
_LATE_UPLOAD_LEARNER = """
import sys, time
import streamrl.learner.publish as publish
leave, late = publish._leave_cores_to_training, [float(sys.argv[2])]
def starved():
    time.sleep(late.pop() if late else 0.0)
    leave()
publish._leave_cores_to_training = starved
from streamrl.learner import run_learner
from streamrl.learner.topology import exit_process
run_learner(sys.argv[1])
exit_process(0)
"""


def _make_run(run_dir: Path) -> None:
    """A DAPO run of the tiny model over a pre-written stream whose packed rows (a prompt and
    its group's four responses) are ≥ 192 tokens: the CPU flash-attention kernel's larger query
    blocks, where its MKL calls feel the flag."""
    config = load_config(
        ["dapo", "tiny-cpu"],
        overrides=[
            f"storage.run_uri={run_dir}",
            f"learner.total_steps={STEPS}",
            "learner.checkpoint_every=4",
            f"learner.keep_checkpoints={STEPS}",
            "learner.max_staleness=100",  # the pre-written stream is all version 0
            "learner.lr=1e-3",
        ],
    )
    create_run(open_location(str(run_dir)), config.model_dump(mode="json"))
    rng = np.random.default_rng(0)
    groups = [
        random_group(rng, prompt_id=f"p{i % 6}", vocab=600, min_len=24, max_len=32,
                     prompt_len=100)
        for i in range(4 * STEPS + 40)
    ]  # fmt: skip
    writer = StreamWriter(open_location(str(run_dir)), "gen0")
    for first in range(0, len(groups), 5):
        writer.write(groups[first : first + 5])


def _train(run_dir: Path, *, busy: int, upload_delay_s: float) -> None:
    """Run the learner process to the end, with `busy` busy-loop processes on the machine."""
    with busy_loops(busy):
        proc = subprocess.run(
            [sys.executable, "-c", _LATE_UPLOAD_LEARNER, str(run_dir), str(upload_delay_s)],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            timeout=600,
        )
    assert proc.returncode == 0, proc.stderr[-4000:]


def _checkpoint_tensors(run_dir: Path, step: int, scratch: Path) -> dict[str, torch.Tensor]:
    """Every tensor of checkpoint `step` (models, optimiser state, RNG), by flattened key."""
    flat = scratch / f"{run_dir.name}-{step}.pt"
    dcp_to_torch_save(str(run_dir / "checkpoints" / f"step-{step:08d}"), str(flat))
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: object, key: str) -> None:
        if isinstance(value, dict):
            for name, item in value.items():
                walk(item, f"{key}.{name}" if key else str(name))
        elif isinstance(value, torch.Tensor):
            tensors[key] = value

    walk(torch.load(flat, weights_only=False), "")
    return tensors


def test_learner_checkpoints_are_bit_identical_idle_and_under_cpu_contention(tmp_path):
    idle, contended = tmp_path / "idle", tmp_path / "contended"
    for run_dir in (idle, contended):
        _make_run(run_dir)
    _train(idle, busy=0, upload_delay_s=0.0)
    _train(contended, busy=2, upload_delay_s=8.0)

    steps = CheckpointStore(open_location(str(idle))).committed_steps()
    assert steps == [4, 8, 12]
    assert CheckpointStore(open_location(str(contended))).committed_steps() == steps
    for step in steps:
        expected = _checkpoint_tensors(idle, step, tmp_path)
        actual = _checkpoint_tensors(contended, step, tmp_path)
        assert any(".optim.state." in key for key in expected)  # fp32 optimiser state too
        assert expected.keys() == actual.keys()
        differing = [key for key in expected if not torch.equal(expected[key], actual[key])]
        assert not differing, f"step {step}: {len(differing)} tensors differ: {differing[:5]}"
