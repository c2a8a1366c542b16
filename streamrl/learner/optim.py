"""AdamW, the learning-rate schedule and gradient clipping, FSDP2-aware.

The actor and the critic (VAPO) each get their own optimiser and scheduler from these
functions, with `learner.lr` and `learner.critic_lr` respectively.

Weight decay applies to matrices only (linear and embedding weights, `ndim ≥ 2`); biases and
normalisation weights (`ndim < 2`) are not decayed — the usual practice (GPT-2/nanoGPT,
torchtitan), since shrinking a scale or an offset towards 0 regularises nothing useful.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import partial
from typing import get_args

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from streamrl.learner.config import Schedule

__all__ = ["build_optimizer", "build_scheduler", "clip_grad_norm", "lr_factor"]


def build_optimizer(
    params: Iterable[nn.Parameter],
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW over the trainable `params` (pass `model.parameters()` after `shard_model`).

    Two parameter groups, always in this order so optimiser checkpoints line up: matrices
    with `weight_decay`, then biases and norm weights with none. `lr` is the peak rate; the
    scheduler scales it."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("build_optimizer got no trainable parameters (all requires_grad=False)")
    groups = [
        {"params": [p for p in trainable if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def lr_factor(
    step: int,
    warmup_steps: int,
    total_steps: int,
    schedule: Schedule,
    min_lr_ratio: float,
) -> float:
    """Multiplier of the peak lr for the update after `step` scheduler steps (0-based).

    With n = step + 1 the number of that update: n/W while n ≤ W (linear warm-up; W =
    `warmup_steps`, none when 0); then 1 (constant) or a cosine from 1 at n = W down to
    `min_lr_ratio` at n = `total_steps`, held there afterwards.

    `warmup-times-cosine` is the framework guide's eq 57, "linear warm-up with cosine
    annealing" as a product: min(1, n/W)·cos(π·n/(2T)), T = `total_steps`, n held at T
    afterwards (so 0 from the last update on). The guide prints min(1, W/n), which would start
    at full rate and decay as 1/n — the opposite of the warm-up it names; read as a typo."""
    n = step + 1
    if schedule == "warmup-times-cosine":
        warm = min(1.0, n / warmup_steps) if warmup_steps else 1.0
        return warm * math.cos(math.pi * min(n, total_steps) / (2 * max(1, total_steps)))
    if n <= warmup_steps:
        return n / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (n - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: int,
    schedule: Schedule = "constant",
    min_lr_ratio: float = 0.0,
) -> LambdaLR:
    """`LambdaLR` following `lr_factor`; call `scheduler.step()` after each `optimizer.step()`.

    Steps count scheduler calls: pass `total_steps` in the unit the caller steps it in (learner
    steps, or optimiser updates = learner steps × updates per batch). Its `state_dict` holds
    the position, so a resumed scheduler continues where it stopped."""
    if schedule not in get_args(Schedule):
        raise ValueError(
            f"learner.schedule must be one of {', '.join(get_args(Schedule))}, not {schedule!r}"
        )
    if warmup_steps < 0 or total_steps < 1:
        raise ValueError(
            f"need warmup_steps ≥ 0 and total_steps ≥ 1 (got {warmup_steps}, {total_steps})"
        )
    if warmup_steps > total_steps:
        raise ValueError(
            f"learner.warmup_steps ({warmup_steps}) exceeds learner.total_steps ({total_steps}): "
            "the peak lr would never be reached; lower warmup_steps"
        )
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"learner.min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    factor = partial(
        lr_factor,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        schedule=schedule,
        min_lr_ratio=min_lr_ratio,
    )
    return LambdaLR(optimizer, factor)


def clip_grad_norm(model: nn.Module | Iterable[nn.Parameter], max_norm: float | None) -> float:
    """The global L2 norm of all gradients (over every rank's shards), clipped to `max_norm`.

    Works on FSDP2 (DTensor) and plain parameters alike; the result is the same on every rank
    and equals `torch.nn.utils.clip_grad_norm_` on the unsharded model. `max_norm=None` only
    measures. A non-finite norm is returned without scaling the gradients: the caller should
    skip that optimiser step (and count it)."""
    params = list(model.parameters() if isinstance(model, nn.Module) else model)
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        return 0.0
    total = torch.nn.utils.get_total_norm([p.grad for p in with_grad], norm_type=2.0)
    if isinstance(total, DTensor):  # per-shard partial norms: reduce over the mesh
        total = total.full_tensor()
    if max_norm is not None and torch.isfinite(total):
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, total)
    return float(total)
