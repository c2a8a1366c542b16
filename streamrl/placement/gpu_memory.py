"""The memory of a GPU that the learner and engines share, planned together before anything starts.

When `streamrl.placement.planner` puts several processes of a run on one GPU, each gets a
fraction of the device's memory (`ProcessPlacement.gpu_memory_fraction`, passed to it as
`GPU_SHARE_VARIABLE`):

- an engine (generator, evaluator, served scorer) its `gpu_memory_utilization` when the config
  sets one, else an equal part of what the learner leaves; vLLM sizes its KV cache to it;
- the learner `learner.gpu_memory_fraction` when set, else what it needs (below) plus a quarter;
  it caps its allocator there (`cap_learner_memory`), so it fails inside its own share instead
  of taking an engine's.

Every process also keeps `CONTEXT_RESERVE_GIB` outside its fraction for its CUDA context. The
plan is refused, with the numbers, when the shares add up to more than the device holds, or
when a share is below the least its process needs:

- the learner: AdamW training in fp32 master weights — parameters, gradients and two moments,
  16 bytes a trainable parameter, 4 a frozen one (LoRA), divided between its ranks by FSDP —
  plus one micro-batch's activations: `34 · hidden · layers` bytes a token in 16-bit compute
  (Korthikanti et al. 2022; twice that in fp32; `2 · hidden · layers` plus one layer's with
  activation checkpointing) and the logits of the micro-batch in fp32 with their gradient; when
  it hands versions to the engines beside it (`streamrl.placement.handoff`), also two copies
  of its shard in the published dtype;
- an engine: the weights in `model.dtype` plus the KV cache of one full-length sequence.

These are estimates of the least that can work, not of what runs fast: a refused plan names
them so a user can see what to change (fewer engines on the GPU, activation checkpointing,
LoRA, a smaller micro-batch, `generator.gpu_memory_utilization`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from streamrl.placement.config import PlacementError
from streamrl.placement.records import GPU_SHARE_VARIABLE
from streamrl.scorers.config import scorer_process_name

if TYPE_CHECKING:
    from streamrl.config.run import RunConfig

__all__ = [
    "CONTEXT_RESERVE_GIB",
    "GIB",
    "ModelShape",
    "SharedGpu",
    "cap_learner_memory",
    "engine_memory_utilization",
    "gpu_memory_bytes",
    "model_shape",
    "plan_shared_memory",
    "planned_share",
    "share_gpu_memory",
]

GIB = 1 << 30
CONTEXT_RESERVE_GIB = 0.75  # a CUDA context, cuBLAS workspaces and NCCL buffers, per process
LEARNER_HEADROOM = 1.25  # the learner's share over its least need, when the config sets none
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """What the memory plan needs to know of the policy model."""

    parameters: int
    hidden_size: int
    layers: int
    vocab_size: int
    kv_bytes_per_token: int  # keys and values of every layer, in the model's dtype


@dataclass(frozen=True)
class SharedGpu:
    """One GPU's users: the learner (its ranks on it: one) and engines by process name with the
    utilisation their config asks for (None: planned)."""

    gpu: str
    learner: bool
    engines: Mapping[str, float | None]


def model_shape(config: RunConfig) -> ModelShape:
    """The policy's shape from its config file (`model.path`), its parameters counted on the
    meta device (nothing is loaded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from streamrl.models.cache import resolve_model_path

    path = resolve_model_path(config.model.path)
    hf = AutoConfig.from_pretrained(path, trust_remote_code=config.model.trust_remote_code)
    text = getattr(hf, "text_config", None) or hf
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            hf, trust_remote_code=config.model.trust_remote_code
        )
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    dtype = _DTYPE_BYTES[config.model.dtype]
    return ModelShape(
        parameters=sum(p.numel() for p in model.parameters()),
        hidden_size=text.hidden_size,
        layers=text.num_hidden_layers,
        vocab_size=text.vocab_size,
        kv_bytes_per_token=2 * text.num_hidden_layers * kv_heads * head_dim * dtype,
    )


def learner_need_bytes(config: RunConfig, shape: ModelShape, handoff: bool = False) -> int:
    """The least memory one learner rank needs (module docstring); with `handoff`, also its two
    hand-off slots of its shard in the published dtype (`streamrl.placement.handoff`)."""
    learner = config.learner
    slots = 0
    if handoff:
        published = _DTYPE_BYTES[config.weights.resolved_dtype(config.model)]
        slots = 2 * shape.parameters * published // learner.nproc_per_node
    per_parameter = 4 if config.model.lora is not None else 16
    states = shape.parameters * per_parameter // learner.nproc_per_node
    tokens = learner.micro_batch_tokens
    compute = 4 if config.model.dtype == "float32" else 2
    per_layer_token = 34 * shape.hidden_size * compute // 2
    if learner.activation_checkpointing:
        activations = tokens * (
            2 * shape.hidden_size * shape.layers * compute // 2 + per_layer_token
        )
    else:
        activations = tokens * per_layer_token * shape.layers
    logits = 2 * 4 * tokens * shape.vocab_size
    return states + activations + logits + slots


def engine_need_bytes(config: RunConfig, shape: ModelShape) -> int:
    """The least memory an engine needs: its weights and one full-length sequence's KV cache."""
    weights = shape.parameters * _DTYPE_BYTES[config.model.dtype]
    return weights + shape.kv_bytes_per_token * config.model.max_model_len


def plan_shared_memory(
    config: RunConfig,
    gpus: Sequence[SharedGpu],
    total_bytes: Mapping[str, int],
    shape: ModelShape,
    handoff: bool = False,
) -> dict[tuple[str, str], float]:
    """The fraction of each shared GPU's memory that each of its users gets, keyed by (process
    name, GPU); raises `PlacementError` with the numbers when they do not fit. `handoff`: the
    learner keeps hand-off slots."""
    learner_need = learner_need_bytes(config, shape, handoff)
    engine_need = engine_need_bytes(config, shape)
    fractions: dict[tuple[str, str], float] = {}
    for gpu in gpus:
        total = total_bytes[gpu.gpu]
        users = int(gpu.learner) + len(gpu.engines)
        usable = total - users * CONTEXT_RESERVE_GIB * GIB
        asked = sum(u for u in gpu.engines.values() if u is not None) * total
        unplanned = [name for name, u in gpu.engines.items() if u is None]
        shares: dict[str, float] = {}
        if gpu.learner:
            fixed = config.learner.gpu_memory_fraction
            if fixed is not None:
                shares["learner"] = fixed * total
            else:  # its need plus headroom, the headroom only where the engines keep theirs
                room = usable - asked - len(unplanned) * engine_need
                shares["learner"] = max(learner_need, min(LEARNER_HEADROOM * learner_need, room))
        left = usable - shares.get("learner", 0.0) - asked
        each = max(0.0, left / len(unplanned)) if unplanned else 0.0
        for name, u in gpu.engines.items():
            shares[name] = u * total if u is not None else each
        short = any(
            share < (learner_need if name == "learner" else engine_need)
            for name, share in shares.items()
        )
        if sum(shares.values()) > usable or short:
            raise PlacementError(_refusal(gpu, total, usable, shares, learner_need, engine_need))
        for name, share in shares.items():
            fractions[(name, gpu.gpu)] = share / total
    return fractions


def _refusal(
    gpu: SharedGpu,
    total: int,
    usable: float,
    shares: Mapping[str, float],
    learner_need: int,
    engine_need: int,
) -> str:
    def gib(n: float) -> str:
        return f"{n / GIB:.1f} GiB"

    users = ", ".join(
        f"{name} {gib(share)} (needs ≥ {gib(learner_need if name == 'learner' else engine_need)})"
        for name, share in shares.items()
    )
    return (
        f"GPU {gpu.gpu} ({gib(total)}, {gib(usable)} after a CUDA context per process) cannot "
        f"hold {users}: {gib(sum(shares.values()))} in all. The learner needs its fp32 weights, "
        "gradients and AdamW moments and one micro-batch's activations; an engine its weights "
        "and one full-length sequence's KV cache. Put fewer engines on the GPU (generator.count, "
        "or more GPUs), give generator.gpu_memory_utilization or learner.gpu_memory_fraction, "
        "where one is set, a value that fits, or shrink the learner "
        "(learner.activation_checkpointing=true, model.lora, a smaller "
        "learner.micro_batch_tokens)"
    )


def share_gpu_memory(
    config: RunConfig,
    gpu_of: dict[str, list[str]],
    gpu_memory: dict[str, int] | None,
    model: ModelShape | None,
    handoff: bool = False,
) -> tuple[dict[str, float], list[str]]:
    """Given each process's GPUs (`gpu_of`, by process name): each process's fraction of its
    shared GPUs' memory (the least over its GPUs) and the reasons in words; empty when no GPU is
    shared. GPU sizes (`gpu_memory`) and the model's shape (`model`) are read when not given;
    `handoff`: the learner keeps hand-off slots."""
    holders: dict[str, list[str]] = {}
    for name, at in gpu_of.items():
        for gpu in at:
            holders.setdefault(gpu, []).append(name)
    shared = {gpu: names for gpu, names in holders.items() if len(names) > 1}
    if not shared:
        return {}, []

    def asked(name: str) -> float | None:
        if name.startswith("scorer-"):
            scorer = next(s for n, s in config.scorers.items() if scorer_process_name(n) == name)
            return (
                scorer.gpu_memory_utilization
                if "gpu_memory_utilization" in scorer.model_fields_set
                else None
            )
        generator = config.generator
        return (
            generator.gpu_memory_utilization
            if "gpu_memory_utilization" in generator.model_fields_set
            else None
        )

    layout = [
        SharedGpu(gpu, "learner" in names, {n: asked(n) for n in names if n != "learner"})
        for gpu, names in shared.items()
    ]
    sizes = gpu_memory if gpu_memory is not None else gpu_memory_bytes(sorted(shared))
    fractions = plan_shared_memory(config, layout, sizes, model or model_shape(config), handoff)
    share: dict[str, float] = {}
    for (name, _), fraction in fractions.items():
        share[name] = min(fraction, share.get(name, 1.0))
    reasons = [
        f"GPU {gpu} ({sizes[gpu] / GIB:.0f} GiB) shared by "
        + ", ".join(f"{n} {fractions[(n, gpu)]:.0%}" for n in names)
        + (" (the learner's allocator capped at its share)" if "learner" in names else "")
        for gpu, names in shared.items()
    ]
    return share, reasons


def gpu_memory_bytes(gpus: Sequence[str]) -> dict[str, int]:
    """Each GPU's total memory, asked in a short-lived process so that this one (a supervisor)
    holds no CUDA context on a GPU it shares out."""
    probe = (
        "import json, torch; print(json.dumps([torch.cuda.get_device_properties(i).total_memory "
        "for i in range(torch.cuda.device_count())]))"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(gpus)}
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        raise PlacementError(
            f"could not read the memory of GPUs {','.join(gpus)} to share them: "
            f"{done.stderr.strip()[-500:]}"
        )
    sizes = json.loads(done.stdout.strip().splitlines()[-1])
    return dict(zip(gpus, sizes, strict=True))


def planned_share() -> float | None:
    """This process's planned fraction of its shared GPU (`GPU_SHARE_VARIABLE`); None when it
    has its GPUs to itself."""
    planned = os.environ.get(GPU_SHARE_VARIABLE)
    if not planned:
        return None
    fraction = float(planned)
    if not 0.0 < fraction < 1.0:
        raise PlacementError(
            f"{GPU_SHARE_VARIABLE}={planned} is not a fraction of a GPU's memory in (0, 1); it "
            "is set by the placement plan: start the process from it (streamrl run)"
        )
    return fraction


def engine_memory_utilization(configured: float) -> float:
    """The `gpu_memory_utilization` a vLLM engine starts with: its planned share on a shared
    GPU, else `configured`."""
    planned = planned_share()
    return configured if planned is None else planned


def cap_learner_memory(device: int) -> float | None:
    """In the learner on a shared GPU: cap its allocator at its planned fraction of `device`
    and return it; None when it has the GPU to itself."""
    fraction = planned_share()
    if fraction is not None:
        import torch

        torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction
