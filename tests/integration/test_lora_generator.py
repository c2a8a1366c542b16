"""LoRA between learner and generator on the tiny model, fp32: the learner publishes only its
adapter (PEFT names, the base named in the manifest); vLLM serves it under one adapter id, swaps
each new version in place — mid-generation too — and its behaviour log-probs are the learner's."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from storage.fs import open_location
from storage.weight_publish import WeightWriter
from storage.weights import WeightStore
from streamrl.config_loading import load_config
from streamrl.generator.engine import Engine, WeightSource
from streamrl.learner.forward import token_scores
from streamrl.learner.loading import build_step_models
from streamrl.learner.lora import adapter_manifest, publish_shares
from streamrl.learner.mini_batches import TrainBatch, make_mini_batches
from streamrl.learner.publish import WeightPublisher
from streamrl.learner.topology import Topology
from streamrl.models import resolve_model_path
from tests.stream_data import random_group

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def config():
    return load_config(
        ["dapo", "tiny-cpu"],
        overrides=[
            f"generator.max_tokens={MAX_TOKENS}",
            "model.lora.rank=8",
            "model.lora.alpha=16",
        ],
    )


@pytest.fixture(scope="module")
def topology(engine):
    # After the engine: vLLM's in-process engine owns the process group (and tears it down at
    # exit); the learner's topology joins it.
    topo = Topology.from_env("cpu")
    yield topo
    topo.destroy()


@pytest.fixture(scope="module")
def policy(config, topology):
    models, _ = build_step_models(config, topology)
    return models.policy.model


@pytest.fixture(scope="module")
def engine(config):
    return Engine(
        resolve_model_path("tiny-qwen2"),
        config.model,
        config.generator,
        seed=0,
        adapter=config.model.lora,
    )


def _set_adapter(policy, seed: int) -> dict[str, torch.Tensor]:
    """Give the learner's adapters random values (both A and B, large enough to move every
    log-prob); returns them by name."""
    generator = torch.Generator().manual_seed(seed)
    values = {}
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if ".lora_" in name:
                value = torch.randn(param.shape, generator=generator) * 0.3
                param.to_local().copy_(value)
                values[name] = value
    return values


def _publish(policy, config, topology, run, version: int) -> None:
    publisher = WeightPublisher(
        WeightWriter(run),
        topology,
        config.weights,
        torch.float32,
        model_config=adapter_manifest(config.model, "adapter"),
        shares=publish_shares(config.model.lora, "adapter"),
    )
    publisher.publish(policy, version)
    publisher.flush()


def _learner_logprobs(policy, prompt: list[int], completion) -> np.ndarray:
    """The learner's log-probs (`token_scores`, the training path) of `completion`'s tokens."""
    group = replace(
        random_group(np.random.default_rng(0), group_size=1, prompt_len=len(prompt)),
        prompt_tokens=np.asarray(prompt, np.int32),
        response_tokens=[completion.token_ids.astype(np.int32)],
        behaviour_logprobs=[completion.logprobs.astype(np.float32)],
        truncated=np.zeros(1, bool),
        finish_reasons=["stop"],
    )
    batch = TrainBatch.from_groups([group])
    (mini,) = make_mini_batches(batch, 1, 4096)
    (micro,) = mini.micro_batches
    with torch.no_grad():
        logp = token_scores(policy, micro)[0]
    return logp[micro.sampled_mask].numpy()


def test_a_published_adapter_is_generated_with_the_learners_logprobs(
    config, topology, policy, engine, tmp_path
):
    run = open_location(str(tmp_path / "run"))
    prompts = [list(range(3, 40)), [11, 12, 13, 14]]
    base = engine.generate(prompts)  # the zero adapter: the base model
    _set_adapter(policy, seed=1)
    _publish(policy, config, topology, run, 1)

    manifest = WeightStore(run).read_manifest(1)
    assert manifest.model_config["lora_base_model"] == config.model.path
    assert manifest.model_config["lora_adapter"]["r"] == 8
    assert all(".lora_" in name for name in WeightStore(run).load(1)[0])
    assert manifest.stored_bytes < 0.2 * sum(p.numel() * 4 for p in policy.parameters())

    found, _ = engine.advance_weights(WeightSource.of(run, config.weights), newer_than=0)
    assert found.version == 1
    groups = engine.generate(prompts)
    for prompt, group, old in zip(prompts, groups, base, strict=True):
        assert group.policy_version == 1
        for completion in group.completions:
            expected = _learner_logprobs(policy, prompt, completion)
            np.testing.assert_allclose(completion.logprobs, expected, atol=1e-4, rtol=0)
        # the adapter changed what the engine computes
        assert not np.allclose(
            _learner_logprobs(policy, prompt, old.completions[0]),
            old.completions[0].logprobs,
            atol=1e-3,
        )


def test_an_adapter_swapped_in_mid_generation_scores_the_tokens_after_it(
    config, topology, policy, engine, tmp_path
):
    """A new version loaded in place while requests run: each token's log-prob is that of the
    adapter version that sampled it (the requests are recomputed under the new one)."""
    run = open_location(str(tmp_path / "run"))
    source = WeightSource.of(run, config.weights)
    adapters = {2: _set_adapter(policy, seed=2)}
    _publish(policy, config, topology, run, 2)
    engine.advance_weights(source, exactly=2)
    prompts = [list(range(5, 30)), [7, 8, 9]]
    ids = [engine.submit(p, max_tokens=MAX_TOKENS) for p in prompts]
    done = {}
    for _ in range(6):
        done.update((g.request_id, g) for g in engine.step())
    adapters[3] = _set_adapter(policy, seed=3)
    _publish(policy, config, topology, run, 3)
    found, _ = engine.advance_weights(source)
    assert found.version == 3
    deadline = time.monotonic() + 120
    while len(done) < len(ids) and time.monotonic() < deadline:
        done.update((g.request_id, g) for g in engine.step())
    seen = set()
    for prompt, request in zip(prompts, ids, strict=True):
        for completion in done[request].completions:
            for version, values in adapters.items():
                with torch.no_grad():
                    for name, param in policy.named_parameters():
                        if name in values:
                            param.to_local().copy_(values[name])
                expected = _learner_logprobs(policy, prompt, completion)
                at = completion.versions == version
                seen.update(completion.versions[at].tolist())
                np.testing.assert_allclose(completion.logprobs[at], expected[at], atol=1e-4)
    assert seen == {2, 3}  # tokens of both versions, each scored by its own adapter
