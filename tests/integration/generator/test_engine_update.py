"""A live weight update is atomic for the requests in flight, with vLLM's engine core in this
process (the CPU default) and in a process of its own (the CUDA default, run here on vLLM's CPU
build).

A greedy request in flight across the update must read, token by token, as the old model up to
some point and the new model from there on — checked against transformers' teacher-forced
log-probs under both weights. A decode step that ran new weights over the old weights' KV
entries (the update not paused) produces a token matching neither.

The newest version is a delta: the fresh engine's workers build it from the full version before
it and the delta, reading the store themselves (only version numbers cross vLLM's RPC).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from storage.fs import open_location
from storage.weights.publish import WeightWriter
from streamrl.models import resolve_model_path

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = [list(range(3, 40)), [11, 12, 13, 14], list(range(100, 150))]


def _teacher_forced(model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    ids = torch.tensor([[*prompt, *tokens]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].numpy()


def _nudged(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with a few elements of the final norm changed, enough to move every logit."""
    nudged = {name: tensor.clone() for name, tensor in state.items()}
    nudged["model.norm.weight"][:3] += 1.0
    return nudged


@pytest.mark.parametrize(
    "engine_process",
    [False, pytest.param(True, marks=pytest.mark.slow)],  # the same sequence, over vLLM's RPC
    ids=["in-process", "engine-process"],
)
def test_requests_in_flight_switch_cleanly_from_old_to_new_weights(tmp_path, engine_process):
    from transformers import AutoModelForCausalLM

    path = resolve_model_path("tiny-qwen2")
    old = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    state = {
        name: p.detach() + 0.5 * p.detach().std() * torch.randn(p.shape, generator=generator)
        for name, p in old.named_parameters()
    }
    newest = _nudged(state)
    new.load_state_dict(newest, strict=False)
    new.tie_weights()
    store = WeightWriter(open_location(str(tmp_path / "run")))
    store.publish(1, state)  # tiny-cpu publishes float32, the dtype of these tensors
    assert store.publish(2, newest, base=(1, state)).base == 1  # stored as a delta

    out = tmp_path / "completions.json"
    worker = [sys.executable, "-m", "tests.integration.generator.engine_update_worker"]
    done = subprocess.run(
        [*worker, str(tmp_path / "run"), str(out), json.dumps(PROMPTS), str(int(engine_process))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    result = json.loads(out.read_text())
    assert result["advance"] == {"version": 2, "corrupt": {}, "vanished": []}
    assert result["version"] == 2
    for prompt, completion in zip(PROMPTS, result["completions"], strict=True):
        tokens, logprobs = completion["tokens"], np.array(completion["logprobs"])
        assert completion["policy_version"] == 0  # the oldest weights that produced a token
        as_old = np.abs(logprobs - _teacher_forced(old, prompt, tokens)) < 1e-4
        as_new = np.abs(logprobs - _teacher_forced(new, prompt, tokens)) < 1e-4
        switch = int(np.argmin(as_old))  # the first token the old weights did not produce
        assert 0 < switch < len(tokens), "the update did not land while the request was in flight"
        assert as_old[:switch].all()
        assert as_new[switch:].all(), (
            f"tokens {np.flatnonzero(~as_new[switch:]) + switch} of {len(tokens)} match neither "
            f"weights: decoded with new weights over the old ones' KV cache (switch at {switch})"
        )
