"""Shared pieces of the advantage tests (`tests/unit/test_advantages_*.py`).

Seeded random batches with ragged, non-contiguous groups and ragged right-padded masks, and
the references more than one test file needs, written with explicit Python loops over samples
and tokens straight from the formulas in docs/algorithms.md (computed in Python floats, i.e.
float64). References used by one file only live in that file.
"""

from __future__ import annotations

import math

import torch

ATOL = 1e-5
RTOL = 1e-5
SEEDS = [0, 1, 2, 3, 4]


def close(actual, expected, atol: float = ATOL, rtol: float = RTOL) -> None:
    """assert_close of a tensor against a (nested) list of Python floats, in float32."""
    expected_t = torch.as_tensor(expected, dtype=torch.float64).to(torch.float32)
    torch.testing.assert_close(actual.float(), expected_t, atol=atol, rtol=rtol)


def random_group_index(gen: torch.Generator, num_groups: int, max_size: int = 6) -> torch.Tensor:
    """Dense group ids with ragged sizes in 1..max_size, shuffled (groups not contiguous)."""
    sizes = torch.randint(1, max_size + 1, (num_groups,), generator=gen)
    sizes[0] = 1  # always at least one group of one response
    ids = torch.repeat_interleave(torch.arange(num_groups), sizes)
    return ids[torch.randperm(ids.numel(), generator=gen)].to(torch.int64)


def random_rewards(gen: torch.Generator, n: int, kind: str) -> torch.Tensor:
    if kind == "binary":
        return torch.randint(0, 2, (n,), generator=gen).float() * 2.0 - 1.0
    return torch.randn(n, generator=gen) * 2.0 + 0.3


def random_mask(
    gen: torch.Generator, n: int, t: int, *, allow_empty: bool = True, as_bool: bool = True
) -> torch.Tensor:
    """Right-padded mask with ragged lengths; includes a length-1 row and (optionally) an
    empty row."""
    lo = 0 if allow_empty else 1
    lengths = torch.randint(lo, t + 1, (n,), generator=gen)
    lengths[0] = 1
    if allow_empty and n > 1:
        lengths[1] = 0
    if n > 2:
        lengths[2] = t
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    return mask if as_bool else mask.float()


def group_members(group_index: list[int]) -> dict[int, list[int]]:
    members: dict[int, list[int]] = {}
    for i, g in enumerate(group_index):
        members.setdefault(g, []).append(i)
    return members


def ref_masked_whiten(
    x: list[list[float]], mask: list[list[float]], eps: float = 1e-8
) -> list[list[float]]:
    """(x − μ)/sqrt(σ² + eps), σ² the unbiased variance over the valid elements.

    With a single valid element the unbiased variance has no meaning; the implementation's
    convention is to divide by max(n − 1, 1), which the output does not depend on then anyway
    (x − μ = 0).
    """
    vals = [x[i][t] for i in range(len(x)) for t in range(len(x[i])) if mask[i][t]]
    n = len(vals)
    mu = sum(vals) / n if n else 0.0
    var = sum((v - mu) ** 2 for v in vals) / max(n - 1, 1)
    denom = math.sqrt(var + eps)
    out = []
    for i in range(len(x)):
        out.append([(x[i][t] - mu) / denom if mask[i][t] else 0.0 for t in range(len(x[i]))])
    return out


def ref_outcome_token_rewards(rewards: list[float], mask: list[list[float]]) -> list[list[float]]:
    out = []
    for i in range(len(mask)):
        row = [0.0] * len(mask[i])
        valid = [t for t in range(len(mask[i])) if mask[i][t]]
        if valid:
            row[max(valid)] = rewards[i]
        out.append(row)
    return out
