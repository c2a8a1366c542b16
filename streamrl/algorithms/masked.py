"""Masked and grouped reductions shared by advantages and losses.

Layout used throughout `streamrl.algorithms`:

* A batch holds N responses, right-padded to T tokens: per-token tensors are `[N, T]` and a
  `mask: [N, T]` (bool or 0/1 float) marks the tokens that count.
* Responses belong to groups (one prompt, G samples). `group_index: [N] int64` gives each
  response's group as a dense id in `0 .. num_groups - 1`. Groups need not be contiguous or of
  equal size, so a batch may mix group sizes and G = 1 is legal.

Everything here is vectorised (scatter/index_add over groups, no Python loops over samples)
and computed in float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "group_centred",
    "group_count",
    "group_mean",
    "group_std",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "masked_whiten_jointly",
    "zero_outside",
]


def zero_outside(x: Tensor, mask: Tensor) -> Tensor:
    """x where mask ≠ 0, else exactly 0 — by selection, so inf/NaN padding cannot leak.

    `x·mask` would turn an infinite padding value into NaN (inf · 0). `x, mask: [N, T]` →
    `[N, T]` float32.
    """
    return torch.where(mask != 0, x.float(), 0.0)


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """Σ x over elements where mask ≠ 0. `x, mask: [N, T]` → scalar float32."""
    return zero_outside(x, mask).sum()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Σ x·mask / Σ mask (0 when the mask is empty, never NaN). `x, mask: [N, T]` → scalar."""
    mask = mask.float()
    return masked_sum(x, mask) / mask.sum().clamp(min=1.0)


def masked_whiten(
    x: Tensor,
    mask: Tensor,
    eps: float = 1e-8,
    process_group: torch.distributed.ProcessGroup | None = None,
) -> Tensor:
    """(x − μ) / sqrt(σ² + eps) with μ, σ² the mean and unbiased variance over masked elements.

    Args:
        x: `[N, T]` values.
        mask: `[N, T]` which elements enter the statistics and the output.
        process_group: when given (and torch.distributed is initialised), μ and σ² are taken
            over the masked elements of *all ranks* — "normalised over the whole global batch".
            Two all-reduces of tiny tensors; the result is identical to whitening the
            concatenated batch.

    Returns `[N, T]` float32, zero where `mask` is 0.
    """
    mask = mask.float()
    x = x.float()
    # Two passes (mean, then squared deviations) for accuracy; two tiny all-reduces when global.
    first = torch.stack([(x * mask).sum(), mask.sum()])
    if process_group is not None:
        torch.distributed.all_reduce(first, group=process_group)
    total, count = first.unbind()
    mean = total / count.clamp(min=1.0)
    sq_dev = (((x - mean) ** 2) * mask).sum()
    if process_group is not None:
        torch.distributed.all_reduce(sq_dev, group=process_group)
    var = sq_dev / (count - 1.0).clamp(min=1.0)
    return (x - mean) * torch.rsqrt(var.clamp(min=0.0) + eps) * mask


def masked_whiten_jointly(
    xs: Sequence[Tensor],
    masks: Sequence[Tensor],
    eps: float = 1e-8,
    process_group: torch.distributed.ProcessGroup | None = None,
) -> list[Tensor]:
    """`masked_whiten` of several tensors together: μ and σ² over the masked elements of all of
    them (and of all ranks with `process_group`), as if they were one batch.

    The learner whitens its micro-batches this way, each `[n_k, T_k]` with its own padding:
    the masked elements are gathered into one flat row (in order), whitened, and put back.

    Args:
        xs: `[n_k, T_k]` values, one tensor per piece of the batch.
        masks: `[n_k, T_k]` bool or 0/1, which elements enter the statistics and the output.

    Returns one `[n_k, T_k]` float32 tensor per piece, zero where its mask is 0.
    """
    keep = [mask.bool() for mask in masks]
    pieces = [x[k] for x, k in zip(xs, keep, strict=True)]
    flat = torch.cat(pieces)[None]
    whitened = masked_whiten(flat, torch.ones_like(flat), eps, process_group)[0]
    out = []
    for x, k, piece in zip(xs, keep, whitened.split([p.numel() for p in pieces]), strict=True):
        result = torch.zeros_like(x, dtype=torch.float32)
        result[k] = piece
        out.append(result)
    return out


def group_count(group_index: Tensor, num_groups: int) -> Tensor:
    """Responses per group. `group_index: [N] int64` → `[num_groups]` float32."""
    ones = torch.ones_like(group_index, dtype=torch.float32)
    return torch.zeros(num_groups, device=group_index.device).index_add_(0, group_index, ones)


def group_mean(values: Tensor, group_index: Tensor, num_groups: int) -> Tensor:
    """Mean of `values: [N]` over each group → `[num_groups]` float32 (0 for empty groups)."""
    values = values.float()
    sums = torch.zeros(num_groups, device=values.device).index_add_(0, group_index, values)
    return sums / group_count(group_index, num_groups).clamp(min=1.0)


def group_centred(values: Tensor, group_index: Tensor, num_groups: int) -> Tensor:
    """Each value less its group's mean: `[N]` → `[N]` float32."""
    values = values.float()
    return values - group_mean(values, group_index, num_groups)[group_index]


def group_std(values: Tensor, group_index: Tensor, num_groups: int) -> Tensor:
    """Unbiased (N − 1) standard deviation of `values: [N]` per group → `[num_groups]`.

    Matches `torch.std` per group; groups of one response get 0 (not NaN).
    """
    values = values.float()
    mean = group_mean(values, group_index, num_groups)
    sq_dev = (values - mean[group_index]) ** 2
    sums = torch.zeros(num_groups, device=values.device).index_add_(0, group_index, sq_dev)
    dof = (group_count(group_index, num_groups) - 1.0).clamp(min=1.0)
    return torch.sqrt(sums / dof)
