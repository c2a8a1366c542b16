"""The learner's CUDA paths on one GPU, against its CPU path: one FSDP2 rank over NCCL (a
one-rank process group, as `Topology.from_env` makes without torchrun) on the tiny model.

- fp32 on CUDA matches the CPU step to float rounding: loss, gradient norm, entropy (rtol 1e-5)
  and the updated parameters (rtol 1e-5, atol lr/100: where a gradient element is near zero,
  AdamW's g/(|g|+eps) magnifies rounding, so parameters are compared to a hundredth of a step).
- bf16 mixed precision (`learner.mixed_precision=bf16`, what the GPU presets run): the decoder's
  matmuls run in bf16 while the parameters and AdamW's moments stay fp32 and the log-probs and
  entropies the loss sees are fp32; the response tokens' mean negative log-likelihood, the
  entropy and the policy loss stay within 2e-2 (relative) of the CPU fp32 step's.
- Publishing from GPU memory through `WeightPublisher` (full and delta bf16 versions) writes the
  same tensors and the same number of bytes as publishing the same weights from CPU.

Run on a machine with a GPU: `pytest -m gpu tests/gpu` (excluded from the default run).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoConfig

import streamrl.learner.objective as objective
from storage.fs import open_location
from storage.weights.versions import WeightStore
from streamrl.config.loading import load_config
from streamrl.config.run import RunConfig
from streamrl.learner.loading import build_step_models
from streamrl.learner.mini_batches import TrainBatch, make_mini_batches
from streamrl.learner.model import decoder_layers, full_state_dict
from streamrl.learner.step import StepSettings, train_on_batch
from streamrl.learner.topology import Topology
from streamrl.models import resolve_model_path
from tests.integration.learner import publish_worker
from tests.stream_data import random_group

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MAX_TOKENS = 32
GROUPS = 4
FP32_RTOL = 1e-5
BF16_RTOL = 2e-2


def learner_config(device: str, mixed_precision: str, mini_batch_groups: int) -> RunConfig:
    """DAPO on the tiny model, on `device` with `mixed_precision`."""
    return load_config(
        ["dapo", "tiny-cpu"],
        overrides=[
            f"learner.device={device}",
            f"learner.mixed_precision={mixed_precision}",
            f"learner.batch_groups={GROUPS}",
            f"learner.mini_batch_groups={mini_batch_groups}",
            f"generator.max_tokens={MAX_TOKENS}",
        ],
    )


def fixed_batch(seed: int = 0) -> TrainBatch:
    """GROUPS random groups whose behaviour log-probs are near the random model's (≈ −log V),
    so that the importance weights sit near 1 and the loss is not a sum of tiny terms."""
    vocab = AutoConfig.from_pretrained(resolve_model_path("tiny-qwen2")).vocab_size
    rng = np.random.default_rng(seed)
    groups = []
    for i in range(GROUPS):
        group = random_group(rng, prompt_id=f"p{i}", vocab=vocab, max_len=MAX_TOKENS)
        near = [np.full(len(t), -np.log(vocab), np.float32) for t in group.response_tokens]
        groups.append(replace(group, behaviour_logprobs=near))
    return TrainBatch.from_groups(groups)


@dataclass
class StepResult:
    """What one learner step on `fixed_batch` gave."""

    metrics: dict[str, float]
    state: dict[str, torch.Tensor]  # full parameters after the step, on CPU
    param_dtypes: set[torch.dtype]
    moment_dtypes: set[torch.dtype]
    seen: dict[str, Any] = field(default_factory=dict)  # what the loss and the layers saw


def learner_step(device: str, mixed_precision: str, mini_batch_groups: int) -> StepResult:
    """One `train_on_batch` on `fixed_batch` with the learner's own models (meta-built,
    sharded, filled) on a fresh one-rank topology, watching what the loss and layer 0 see."""
    config = learner_config(device, mixed_precision, mini_batch_groups)
    cfg, batch = config.learner, fixed_batch()
    seen: dict[str, Any] = {"scores": []}
    real_token_scores = objective.token_scores

    def watched_token_scores(model, micro, **kwargs):
        logp, entropy = real_token_scores(model, micro, **kwargs)
        mask = micro.response_mask
        seen["scores"].append((logp.dtype, entropy.dtype, float(-logp.detach()[mask].mean())))
        return logp, entropy

    def watch_matmul_dtype(module, args, output) -> None:  # None: the output is kept
        seen.setdefault("matmul_dtype", output.dtype)

    with Topology.from_env(device) as topology:
        models, shared_prompt = build_step_models(config, topology)
        policy = models.policy.model
        q_proj = decoder_layers(policy)[0].self_attn.q_proj
        hook = q_proj.register_forward_hook(watch_matmul_dtype)
        minis = make_mini_batches(
            batch,
            cfg.mini_batch_groups,
            cfg.micro_batch_tokens,
            overlong_filter=config.algorithm.overlong.filter,
            shared_prompt=shared_prompt,
        )
        objective.token_scores = watched_token_scores
        try:
            metrics = train_on_batch(
                models, batch, minis, config.algorithm, StepSettings.from_config(config), topology
            )
        finally:
            objective.token_scores = real_token_scores
            hook.remove()
        state = full_state_dict(policy, topology)
        moments = models.policy.optimizer.state.values()
        return StepResult(
            metrics=metrics,
            state=state,
            param_dtypes={p.dtype for p in policy.parameters()},
            moment_dtypes={s["exp_avg"].dtype for s in moments}
            | {s["exp_avg_sq"].dtype for s in moments},
            seen=seen,
        )


def test_fp32_on_cuda_matches_the_cpu_step():
    cpu = learner_step("cpu", "fp32", mini_batch_groups=GROUPS)
    cuda = learner_step("cuda", "fp32", mini_batch_groups=GROUPS)
    assert cuda.seen["matmul_dtype"] == torch.float32
    for name in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert cuda.metrics[name] == pytest.approx(cpu.metrics[name], rel=FP32_RTOL, abs=1e-7), name
    lr = learner_config("cpu", "fp32", GROUPS).learner.lr
    assert list(cuda.state) == list(cpu.state)
    for name, value in cpu.state.items():
        torch.testing.assert_close(cuda.state[name], value, rtol=FP32_RTOL, atol=lr / 100)


def test_bf16_mixed_precision_keeps_fp32_masters_and_fp32_log_probs():
    cpu = learner_step("cpu", "fp32", mini_batch_groups=GROUPS // 2)  # two updates: proximal
    cuda = learner_step("cuda", "bf16", mini_batch_groups=GROUPS // 2)
    assert cuda.seen["matmul_dtype"] == torch.bfloat16  # the layers compute in bf16 ...
    assert cuda.param_dtypes == {torch.float32}  # ... from fp32 master weights
    assert cuda.moment_dtypes == {torch.float32}
    assert {(logp, entropy) for logp, entropy, _ in cuda.seen["scores"]} == {
        (torch.float32, torch.float32)
    }
    # The first micro-batch's scores come from the same (initial) weights on both devices.
    nll_cpu, nll_cuda = cpu.seen["scores"][0][2], cuda.seen["scores"][0][2]
    assert nll_cuda == pytest.approx(nll_cpu, rel=BF16_RTOL)
    for name in ("actor/pg_loss", "actor/entropy"):
        assert cuda.metrics[name] == pytest.approx(cpu.metrics[name], rel=BF16_RTOL), name
    assert all(np.isfinite(v) for v in cuda.metrics.values())
    assert cuda.metrics["actor/grad_norm"] > 0


def test_publishing_from_gpu_memory_writes_what_cpu_writes(tmp_path):
    stores = {}
    for device in ("cpu", "cuda"):
        with Topology.from_env(device) as topology:
            publish_worker.publish_versions(str(tmp_path / device), topology)
        stores[device] = WeightStore(open_location(str(tmp_path / device)))
    cpu, cuda = stores["cpu"], stores["cuda"]
    assert cuda.versions() == cpu.versions() == [1, 2, 3]
    for version in (1, 2, 3):
        (cpu_weights, cpu_manifest), (cuda_weights, cuda_manifest) = (
            cpu.load(version),
            cuda.load(version),
        )
        assert list(cuda_weights) == list(cpu_weights)
        for name, tensor in cpu_weights.items():
            assert cuda_weights[name].dtype == tensor.dtype == torch.bfloat16, name
            assert torch.equal(cuda_weights[name].view(torch.int16), tensor.view(torch.int16))
        assert cuda_manifest.stored_bytes == cpu_manifest.stored_bytes
        assert cuda_manifest.base == cpu_manifest.base
