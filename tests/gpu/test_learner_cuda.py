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
- FlexAttention with a block mask (`learner.attention=flex_attention`) trains as SDPA with the
  dense mask does, within bf16 tolerance.
- LoRA under bf16 mixed precision: only the adapters move, with fp32 masters and moments, and
  the loss matches the CPU step's.
- The fused LM-head pass (`head_logprobs_and_entropy`) against the plain one (whole logits,
  log-softmax, autograd) on Qwen2.5-0.5B's head shape, in fp32 and bf16.

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
from streamrl.algorithms.logits import head_logprobs_and_entropy
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
BF16_TOLERANCE = {"rtol": 2e-2, "atol": 5e-2}  # log-probs of bf16 logits (|log p| up to ~15)


def learner_config(
    device: str, mixed_precision: str, mini_batch_groups: int, extra: tuple[str, ...] = ()
) -> RunConfig:
    """DAPO on the tiny model, on `device` with `mixed_precision` (and `extra` overrides)."""
    return load_config(
        ["dapo", "tiny-cpu"],
        overrides=[
            f"learner.device={device}",
            f"learner.mixed_precision={mixed_precision}",
            f"learner.batch_groups={GROUPS}",
            f"learner.mini_batch_groups={mini_batch_groups}",
            f"generator.max_tokens={MAX_TOKENS}",
            *extra,
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
    initial: dict[str, torch.Tensor]  # and before it
    param_dtypes: set[torch.dtype]
    moment_dtypes: set[torch.dtype]
    seen: dict[str, Any] = field(default_factory=dict)  # what the loss and the layers saw


def learner_step(
    device: str, mixed_precision: str, mini_batch_groups: int, extra: tuple[str, ...] = ()
) -> StepResult:
    """One `train_on_batch` on `fixed_batch` with the learner's own models (meta-built,
    sharded, filled) on a fresh one-rank topology, watching what the loss and layer 0 see."""
    config = learner_config(device, mixed_precision, mini_batch_groups, extra)
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
        initial = {k: v.clone() for k, v in full_state_dict(policy, topology).items()}
        seen["backend"] = topology.backend
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
            initial=initial,
            param_dtypes={p.dtype for p in policy.parameters()},
            moment_dtypes={s["exp_avg"].dtype for s in moments}
            | {s["exp_avg_sq"].dtype for s in moments},
            seen=seen,
        )


def test_fp32_on_cuda_matches_the_cpu_step():
    cpu = learner_step("cpu", "fp32", mini_batch_groups=GROUPS)
    cuda = learner_step("cuda", "fp32", mini_batch_groups=GROUPS)
    assert cuda.seen["backend"] == "nccl"  # FSDP2's collectives over NCCL, on one rank
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


def test_flex_attention_trains_as_sdpa_on_cuda():
    """`learner.attention=flex_attention` (a BlockMask on shared-prompt rows) against SDPA's
    dense mask, both bf16 on CUDA: the same scores, loss, gradient norm and update within bf16
    tolerance."""
    sdpa = learner_step("cuda", "bf16", GROUPS, ("learner.attention=sdpa",))
    flex = learner_step("cuda", "bf16", GROUPS, ("learner.attention=flex_attention",))
    for name in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert flex.metrics[name] == pytest.approx(sdpa.metrics[name], rel=BF16_RTOL), name
    assert flex.seen["scores"][0][2] == pytest.approx(sdpa.seen["scores"][0][2], rel=BF16_RTOL)
    update = lambda step: torch.cat(  # noqa: E731
        [(step.state[k] - step.initial[k]).flatten() for k in step.state]
    )
    flex_update, sdpa_update = update(flex), update(sdpa)
    assert sdpa_update.norm() > 0
    assert (flex_update - sdpa_update).norm() / sdpa_update.norm() < 0.1


def test_lora_trains_only_its_adapters_on_cuda_as_on_cpu():
    """LoRA (model.lora) under bf16 mixed precision on CUDA: the frozen base is bit-identical
    after the step, the adapters moved, the optimiser holds fp32 moments of the adapters only,
    and the loss and entropy match the CPU fp32 step's within bf16 tolerance (B starts at zero:
    the first step scores the base model)."""
    lora = ("model.lora.rank=4", "model.lora.alpha=8")
    cpu = learner_step("cpu", "fp32", GROUPS, lora)
    cuda = learner_step("cuda", "bf16", GROUPS, lora)
    adapters = [name for name in cuda.state if "lora_" in name]
    assert adapters
    assert list(cuda.state) == list(cpu.state)
    for name, value in cuda.state.items():
        if name in adapters:
            continue
        assert torch.equal(value, cuda.initial[name]), f"the frozen {name} changed"
    moved = [n for n in adapters if not torch.equal(cuda.state[n], cuda.initial[n])]
    assert any("lora_B" in name for name in moved)
    assert cuda.moment_dtypes == {torch.float32}
    assert cuda.param_dtypes == {torch.float32}
    for name in ("actor/pg_loss", "actor/entropy"):
        assert cuda.metrics[name] == pytest.approx(cpu.metrics[name], rel=BF16_RTOL), name
    assert cuda.metrics["actor/grad_norm"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_head_pass_matches_the_plain_one_on_cuda(dtype):
    """`head_logprobs_and_entropy` (the LM head applied chunk by chunk to the scoring hidden
    states, its own backward) against the plain pass (the whole logits, log-softmax, autograd) on
    Qwen2.5-0.5B's head shape: log-probs, entropies and both gradients, to float rounding in
    fp32 and within bf16 tolerance in bf16."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows, hidden_size, vocab = 3000, 896, 151936

    def draw(*shape: int, scale: float) -> torch.Tensor:
        x = torch.randn(*shape, generator=generator, device="cuda") * scale
        return x.to(dtype).requires_grad_(True)

    hidden, weight = draw(rows, hidden_size, scale=1.0), draw(vocab, hidden_size, scale=0.05)
    ids = torch.randint(0, vocab, (rows,), generator=generator, device="cuda")
    upstream = torch.randn(rows, generator=generator, device="cuda")

    logp, entropy = head_logprobs_and_entropy(hidden, weight, ids, chunk_tokens=1024)
    (logp * upstream).sum().backward()
    fused = (logp.detach(), entropy, hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None

    log_probs = (hidden @ weight.t()).float().log_softmax(-1)
    plain_logp = log_probs.gather(-1, ids[:, None]).squeeze(-1)
    plain_entropy = -(log_probs.exp() * log_probs).sum(-1).detach()
    (plain_logp * upstream).sum().backward()
    plain = (plain_logp.detach(), plain_entropy, hidden.grad, weight.grad)

    assert fused[0].dtype == fused[1].dtype == torch.float32
    tolerance = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else BF16_TOLERANCE
    torch.testing.assert_close(fused[0], plain[0], **tolerance)
    torch.testing.assert_close(fused[1], plain[1], **tolerance)
    for got, want in zip(fused[2:], plain[2:], strict=True):
        assert got.dtype == want.dtype == dtype
        relative = (got.float() - want.float()).norm() / want.float().norm()
        assert relative < (1e-4 if dtype == torch.float32 else 1e-2)
