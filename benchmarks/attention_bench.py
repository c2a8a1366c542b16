"""Shared-prompt attention in the learner's forward pass: SDPA with a dense mask against
FlexAttention with a block mask (`learner.attention`), on the same micro-batches of one model.

    python3 -m benchmarks.attention_bench --device cuda --model qwen2.5-0.5b-shape \
        --group-size 16 --min-response-len 512 --max-response-len 2048
    .venv/bin/python -m benchmarks.attention_bench --device cpu --model tiny-qwen2 \
        --groups 2 --group-size 4 --min-response-len 8 --max-response-len 32   # forward only

The policy is the learner's own (`build_step_models`: FSDP2 on one rank, on CUDA bf16 mixed
precision with fp32 master weights, the response-only LM head), from random weights of the
model's shape; the micro-batches are shared-prompt rows of synthetic DAPO groups
(`learner_bench.synthetic_groups`, `make_mini_batches` with `learner.micro_batch_tokens`). Each
implementation in turn (`set_attention` on the same model) runs `token_scores` on every
micro-batch and the backward of its log-probs' token-mean (on CPU the forward only: PyTorch has
no FlexAttention backward there): one untimed round (FlexAttention compiles its kernels), then
`--repeats` timed rounds. Figures: response tokens/s (best and mean round), the CUDA allocator's
peak, and how far FlexAttention is from SDPA on the first micro-batch — the mean response NLL's
relative difference, the largest log-prob difference, and the relative L2 difference of the
gradient. `exact` means within bf16's tolerance (`NLL_RTOL`, `GRAD_RTOL`, the bounds of
tests/gpu) on CUDA and within float rounding in fp32.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.learner_bench import (
    MODELS,
    add_shape_arguments,
    shape_overrides,
    synthetic_groups,
)
from benchmarks.learner_measures import device_name, figures_json, synchronize
from streamrl.config.loading import load_config
from streamrl.config.run import RunConfig
from streamrl.learner.forward import set_attention, token_scores
from streamrl.learner.loading import build_step_models
from streamrl.learner.mini_batches import MicroBatch, TrainBatch, make_mini_batches
from streamrl.learner.model import compute_dtype
from streamrl.learner.topology import Topology

IMPLEMENTATIONS = ("sdpa", "flex_attention")
# Within bf16's resolution (8 bits of mantissa) over a whole forward and backward pass.
NLL_RTOL = {"bf16": 2e-2, "fp32": 1e-4}
GRAD_RTOL = {"bf16": 5e-2, "fp32": 1e-3}


def bench_config(args: argparse.Namespace) -> RunConfig:
    """DAPO with the model's size preset at the benchmark's shape (`learner_bench`'s)."""
    return load_config(["dapo", MODELS[args.model][0]], overrides=shape_overrides(args))


def micro_batches(config: RunConfig, vocab: int, args: argparse.Namespace) -> list[MicroBatch]:
    groups = synthetic_groups(
        args.groups, args.group_size, args.min_response_len, args.max_response_len, vocab,
        tuple(args.prompt_len),
    )  # fmt: skip
    batch = TrainBatch.from_groups(groups)
    minis = make_mini_batches(
        batch, args.groups, config.learner.micro_batch_tokens, shared_prompt=True
    )
    return [micro for mini in minis for micro in mini.micro_batches]


def one_round(
    policy: torch.nn.Module, micros: list[MicroBatch], backward: bool, chunk_tokens: int
) -> list[torch.Tensor]:
    """`token_scores` on every micro-batch (and the backward of its token-mean): the
    log-probs, detached."""
    out = []
    with torch.set_grad_enabled(backward):
        for micro in micros:
            logp, _ = token_scores(policy, micro, chunk_tokens=chunk_tokens)
            if backward:
                (-(logp * micro.loss_mask).sum() / max(micro.num_tokens, 1)).backward()
            out.append(logp.detach())
    return out


def flat_grad(policy: torch.nn.Module) -> torch.Tensor:
    """This rank's gradient shards, flat, in fp32 (one rank: the whole gradient)."""
    parts = []
    for p in policy.parameters():
        if p.grad is not None:
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            parts.append(grad.detach().float().reshape(-1))
    return torch.cat(parts)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    config = bench_config(args)
    backward = args.device == "cuda"
    with Topology.from_env(args.device) as topology:
        models, _ = build_step_models(config, topology)
        policy = models.policy.model
        micros = [m.to(topology.device) for m in micro_batches(
            config, policy.config.vocab_size, args
        )]  # fmt: skip
        tokens = sum(m.num_tokens for m in micros)
        rows = sum(m.input_ids.shape[0] for m in micros)
        chunk = config.learner.logprob_chunk_tokens
        bf16 = compute_dtype(config.learner.mixed_precision, topology.device) == torch.bfloat16
        precision = "bf16" if bf16 else "fp32"
        figures: dict[str, Any] = {
            "device": device_name(args.device),
            "precision": precision,
            "backward": backward,
            "micro_batches": len(micros),
            "rows": rows,
            "response_tokens": tokens,
            "forward_tokens": sum(m.input_ids.numel() for m in micros),
        }
        first: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for implementation in IMPLEMENTATIONS:
            set_attention(policy, implementation)
            policy.zero_grad(set_to_none=True)
            started = time.perf_counter()
            logp = one_round(policy, micros[:1], backward, chunk)  # the first micro-batch alone
            first[implementation] = (logp[0], flat_grad(policy) if backward else None)
            policy.zero_grad(set_to_none=True)
            one_round(policy, micros[1:], backward, chunk)  # the rest: compile their shapes
            synchronize(topology.device)
            warm_s = time.perf_counter() - started
            policy.zero_grad(set_to_none=True)
            if topology.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            rounds = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                one_round(policy, micros, backward, chunk)
                synchronize(topology.device)
                rounds.append(time.perf_counter() - started)
                policy.zero_grad(set_to_none=True)
            figures[implementation] = {
                "first_round_s": warm_s,
                "best_s": min(rounds),
                "mean_s": statistics.mean(rounds),
                "tokens_per_s": tokens / min(rounds),
                "peak_MB": torch.cuda.max_memory_allocated() / 1e6
                if topology.device.type == "cuda"
                else None,
            }
            print(f"{implementation}: {figures[implementation]}", flush=True)
        figures |= compare(first, micros[0], precision)
    sdpa, flex = figures["sdpa"], figures["flex_attention"]
    figures["flex_over_sdpa"] = flex["tokens_per_s"] / sdpa["tokens_per_s"]
    figures["faster"] = "flex_attention" if figures["flex_over_sdpa"] > 1 else "sdpa"
    return figures


def compare(
    first: dict[str, tuple[torch.Tensor, torch.Tensor | None]], micro: MicroBatch, precision: str
) -> dict[str, Any]:
    """How far FlexAttention's log-probs and gradient are from SDPA's on the first micro-batch,
    and whether that is within `precision`'s tolerance."""
    mask = micro.sampled_mask
    (logp_s, grad_s), (logp_f, grad_f) = first["sdpa"], first["flex_attention"]
    nll_s, nll_f = -logp_s[mask].mean(), -logp_f[mask].mean()
    out: dict[str, Any] = {
        "nll_rel_diff": float((nll_f - nll_s).abs() / nll_s.abs()),
        "logprob_max_abs_diff": float((logp_f - logp_s)[mask].abs().max()),
        "grad_rel_l2_diff": None
        if grad_s is None
        else float((grad_f - grad_s).norm() / grad_s.norm()),
    }
    out["exact"] = out["nll_rel_diff"] <= NLL_RTOL[precision] and (
        grad_s is None or out["grad_rel_l2_diff"] <= GRAD_RTOL[precision]
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_shape_arguments(parser, default_model="tiny-qwen2")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per implementation")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()
    figures = measure(args)
    print(
        f"\nshared-prompt attention on {figures['device']} ({figures['precision']}, "
        f"{'forward + backward' if figures['backward'] else 'forward only'}), "
        f"{figures['response_tokens']} response tokens in {figures['rows']} rows:\n"
        f"| attention | best s/round | response tokens/s | peak MB |\n|---|---|---|---|"
    )
    for name in IMPLEMENTATIONS:
        f = figures[name]
        peak = "–" if f["peak_MB"] is None else f"{f['peak_MB']:.0f}"
        print(f"| {name} | {f['best_s']:.4g} | {f['tokens_per_s']:.1f} | {peak} |")
    print(
        f"flex_attention / sdpa: {figures['flex_over_sdpa']:.2f}×; NLL rel. diff "
        f"{figures['nll_rel_diff']:.2e}, max |Δ log p| {figures['logprob_max_abs_diff']:.2e}, "
        f"gradient rel. L2 diff {figures['grad_rel_l2_diff']}; exact: {figures['exact']}"
    )
    if args.json:
        Path(args.json).write_text(figures_json(figures))


if __name__ == "__main__":
    main()
