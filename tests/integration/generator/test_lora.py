"""LoRA between learner and generator on the tiny model, fp32: the learner publishes only its
adapter (PEFT names, the base named in the manifest); vLLM serves it under one adapter id, swaps
each new version in place — mid-generation too — and its behaviour log-probs are the learner's.

The engine runs in a fresh interpreter (`lora_engine_worker`); the learner's side here, on one
process without sharding: a DTensor op in pytest's main thread leaves a thread-local cache
holding a gloo process group, which a child forked from a supervisor's thread (later tests)
frees in its `preexec_fn` and crashes on. Publishing from sharded ranks is tested in
test_lora_loop.py and test_lora_learner.py."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from storage.fs import open_location
from storage.weights.publish import WeightWriter
from storage.weights.versions import WeightStore
from streamrl.config.loading import load_config
from streamrl.learner.forward import token_scores, use_hidden_states_head
from streamrl.learner.lora import adapter_manifest
from streamrl.learner.mini_batches import TrainBatch, make_mini_batches
from streamrl.learner.model import load_policy
from streamrl.models import resolve_model_path
from streamrl.models.lora import inject_adapters, peft_name
from tests.integration.generator import lora_engine_worker
from tests.stream_data import random_group

ROOT = Path(__file__).resolve().parents[3]
OVERRIDES = ["generator.max_tokens=32", "model.lora.rank=8", "model.lora.alpha=16"]
PROMPTS = [list(range(3, 40)), [11, 12, 13, 14]]


def _set_adapter(policy, seed: int) -> dict[str, torch.Tensor]:
    """Give the learner's adapters random values (both A and B, large enough to move every
    log-prob); returns them by name."""
    generator = torch.Generator().manual_seed(seed)
    values = {}
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if ".lora_" in name:
                values[name] = torch.randn(param.shape, generator=generator) * 0.3
    _load(policy, values)
    return values


def _load(policy, values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if name in values:
                param.copy_(values[name])


def _publish(policy, config, run, version: int) -> None:
    """The adapter as the learner publishes it: PEFT names, the base in the manifest."""
    adapter = {
        peft_name(name): param.detach().clone()
        for name, param in policy.named_parameters()
        if ".lora_" in name
    }
    WeightWriter(run).publish(
        version, adapter, model_config=adapter_manifest(config.model, "adapter")
    )


def _learner_logprobs(policy, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """The learner's log-probs (`token_scores`, the training path) of `tokens` after `prompt`."""
    group = replace(
        random_group(np.random.default_rng(0), group_size=1, prompt_len=len(prompt)),
        prompt_tokens=np.asarray(prompt, np.int32),
        response_tokens=[np.asarray(tokens, np.int32)],
        behaviour_logprobs=[np.zeros(len(tokens), np.float32)],
        truncated=np.zeros(1, bool),
        finish_reasons=["stop"],
    )
    batch = TrainBatch.from_groups([group])
    (mini,) = make_mini_batches(batch, 1, 4096)
    (micro,) = mini.micro_batches
    with torch.no_grad():
        logp = token_scores(policy, micro)[0]
    return logp[micro.sampled_mask].numpy()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Versions 1 and 2 published by the learner, what the engine sampled, and the adapters."""
    tmp = tmp_path_factory.mktemp("lora-engine")
    config = load_config(["dapo", "tiny-cpu"], overrides=OVERRIDES)
    policy = use_hidden_states_head(load_policy("tiny-qwen2", config.model))
    inject_adapters(policy, config.model.lora)
    run = open_location(str(tmp / "run"))
    adapters = {0: {n: torch.zeros(p.shape) for n, p in policy.named_parameters() if ".lora_" in n}}
    for version in (1, 2):
        adapters[version] = _set_adapter(policy, seed=version)
        _publish(policy, config, run, version)
    out = tmp / "out.json"
    resolve_model_path("tiny-qwen2")
    done = subprocess.run(
        [sys.executable, "-m", lora_engine_worker.__name__, str(tmp / "run"), str(out),
         json.dumps(PROMPTS), json.dumps(OVERRIDES)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return config, policy, run, adapters, json.loads(out.read_text())


def test_a_version_is_the_adapter_alone_naming_its_base(served):
    config, policy, run, _, _ = served
    state, manifest = WeightStore(run).load(1)
    assert manifest.model_config["lora_base_model"] == config.model.path
    assert manifest.model_config["lora_adapter"]["r"] == 8
    assert all(name.startswith("base_model.model.") and ".lora_" in name for name in state)
    assert manifest.stored_bytes < 0.2 * sum(p.numel() * 4 for p in policy.parameters())


def test_the_engine_samples_with_the_learners_logprobs_before_and_after_a_version(served):
    _, policy, _, adapters, result = served
    assert result["loaded"] == [1, 2]
    for version in (0, 1):  # the adapter of zeros is the base; then version 1
        _load(policy, adapters[version])
        other = adapters[1 - version]
        for prompt, group in zip(PROMPTS, result[f"v{version}"], strict=True):
            for completion in group:
                assert set(completion["versions"]) == {version}
                expected = _learner_logprobs(policy, prompt, completion["tokens"])
                np.testing.assert_allclose(completion["logprobs"], expected, atol=1e-4, rtol=0)
        _load(policy, other)  # the other version scores them differently: the swap took effect
        completion = result[f"v{version}"][0][0]
        got = _learner_logprobs(policy, PROMPTS[0], completion["tokens"])
        assert not np.allclose(completion["logprobs"], got, atol=1e-3)


def test_an_adapter_swapped_in_mid_generation_scores_the_tokens_after_it(served):
    """Version 2 loaded in place while requests run: each token's log-prob is that of the
    adapter version that sampled it (the requests are recomputed under the new one)."""
    _, policy, _, adapters, result = served
    seen = set()
    for prompt, group in zip(PROMPTS, result["swapped"], strict=True):
        for completion in group:
            versions = np.asarray(completion["versions"])
            logprobs = np.asarray(completion["logprobs"])
            for version in (1, 2):
                _load(policy, adapters[version])
                expected = _learner_logprobs(policy, prompt, completion["tokens"])
                at = versions == version
                seen.update(versions[at].tolist())
                np.testing.assert_allclose(logprobs[at], expected[at], atol=1e-4, rtol=0)
    assert seen == {1, 2}  # tokens of both versions, each scored by its own adapter
