"""On-policy distillation through a teacher the run serves itself: `streamrl run --preset opd`
starts vLLM's server for the teacher as a component of the run (placed, supervised), the
generator has it score every sampled token off the sampling path, the records carry its
log-probs and the learner trains on them.

One run of the tiny model, with the teacher's vLLM server killed once while the run goes on:
the supervisor restarts it (on another port, published in the run's storage), the generator's
calls in flight wait and are retried or counted, and the run reaches its last step. The stored
teacher log-probs are then checked against transformers' on the same token ids, and nothing of
the teacher is left running."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from storage.control.endpoints import read_endpoint
from storage.fs import open_location
from storage.stream.reader import StreamReader
from streamrl.models import resolve_model_path

ROOT = Path(__file__).resolve().parents[3]
STEPS = 6


def _teacher_logprobs(model, prompt: np.ndarray, response: np.ndarray) -> np.ndarray:
    ids = torch.from_numpy(np.concatenate([prompt, response]).astype(np.int64))[None]
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    return logp[len(prompt) - 1 :].numpy()


def _kill_the_server_once(run_dir: Path, log: list[str]) -> None:
    """Once the teacher is up and a segment of scored groups is committed, SIGKILL its vLLM
    server: the learner still needs most of its groups."""
    run = open_location(str(run_dir))
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        endpoint = read_endpoint(run, "scorer-teacher")
        if endpoint is not None and any((run_dir / "stream" / "log").glob("*.json")):
            os.kill(endpoint.pid, signal.SIGKILL)
            log.append(endpoint.url)
            return
        time.sleep(0.2)
    raise AssertionError("the teacher never came up, or no scored group was committed")


@pytest.mark.timeout(1500)
def test_a_run_distils_from_the_teacher_it_serves_and_survives_the_teacher_dying(tmp_path):
    run_dir = tmp_path / "run"
    argv = [
        sys.executable, "-m", "streamrl", "run", "--preset", "opd", "--preset", "tiny-cpu",
        f"storage.run_uri={run_dir}",
        "scorers.teacher.model=tiny-qwen2",
        "scorers.teacher.dtype=float32",
        f"learner.total_steps={STEPS}",
        "learner.batch_groups=2",
        "learner.mini_batch_groups=2",
        "generator.max_tokens=16",
    ]  # fmt: skip
    process = subprocess.Popen(
        argv, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    killed: list[str] = []
    try:
        _kill_the_server_once(run_dir, killed)
        output, _ = process.communicate(timeout=1200)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output[-4000:]
    assert f"step {STEPS}/{STEPS}" in output
    assert "[scorer-teacher] WARNING: exited with code" in output  # it died and was restarted
    log = (run_dir / "logs" / "scorer-teacher.log").read_text()
    assert log.count("ready at http://127.0.0.1:") == 2, log[-3000:]

    steps = [json.loads(line) for line in (run_dir / "metrics" / "learner.jsonl").open()]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    for step in steps:  # the distillation terms reached the learner's metrics
        assert np.isfinite(step["opd/reverse_kl"])
        assert step["opd/teacher_logp_mean"] < 0
        assert step["rollout/teacher_s_per_group"] > 0

    # Every stored group carries the teacher's log-probs of its tokens: transformers' own.
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(
        resolve_model_path("tiny-qwen2"), torch_dtype=torch.float32
    ).eval()
    run = open_location(str(run_dir))
    groups = [g for _, g in zip(range(4), StreamReader(run).groups(timeout_s=10), strict=False)]
    assert groups
    for group in groups:
        assert group.teacher_logprobs is not None
        assert group.teacher_seconds is not None
        for tokens, stored in zip(group.response_tokens, group.teacher_logprobs, strict=True):
            want = _teacher_logprobs(teacher, np.asarray(group.prompt_tokens), np.asarray(tokens))
            np.testing.assert_allclose(stored, want, atol=2e-4)

    # Nothing of the teacher is left: no server, no published address.
    assert read_endpoint(run, "scorer-teacher") is None
    servers = {int(pid) for pid in re.findall(r"APIServer pid=(\d+)", log)}
    assert len(servers) == 2
    for pid in servers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
