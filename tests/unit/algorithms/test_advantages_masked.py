"""`streamrl.algorithms.masked`, the reductions every estimator is built from: masked sum,
mean and whitening (unbiased variance, eps inside the square root) and the per-group count,
mean and std, each against a loop reference, plus empty, constant and single-element cases.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from streamrl.algorithms.masked import (
    group_count,
    group_mean,
    group_std,
    masked_mean,
    masked_sum,
    masked_whiten,
)
from tests.unit.algorithms.advantage_reference import (
    SEEDS,
    close,
    group_members,
    random_group_index,
    random_mask,
    ref_masked_whiten,
)


def ref_masked_sum(x: list[list[float]], mask: list[list[float]]) -> float:
    total = 0.0
    for i in range(len(x)):
        for t in range(len(x[i])):
            if mask[i][t]:
                total += x[i][t]
    return total


def ref_masked_mean(x: list[list[float]], mask: list[list[float]]) -> float:
    count = sum(1 for row in mask for m in row if m)
    return ref_masked_sum(x, mask) / count if count else 0.0


def ref_group_count(group_index: list[int], num_groups: int) -> list[float]:
    counts = [0.0] * num_groups
    for g in group_index:
        counts[g] += 1.0
    return counts


def ref_group_mean(values: list[float], group_index: list[int], num_groups: int) -> list[float]:
    members = group_members(group_index)
    return [
        statistics.fmean(values[i] for i in members[g]) if g in members else 0.0
        for g in range(num_groups)
    ]


def ref_group_std(values: list[float], group_index: list[int], num_groups: int) -> list[float]:
    members = group_members(group_index)
    out = []
    for g in range(num_groups):
        vals = [values[i] for i in members.get(g, [])]
        out.append(statistics.stdev(vals) if len(vals) >= 2 else 0.0)
    return out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("as_bool", [True, False])
def test_masked_sum_and_mean_match_reference(seed: int, as_bool: bool) -> None:
    """masked_sum / masked_mean equal the looped Σ x·m and Σ x·m / Σ m."""
    gen = torch.Generator().manual_seed(seed)
    n, t = 7, 9
    x = torch.randn(n, t, generator=gen)
    mask = random_mask(gen, n, t, as_bool=as_bool)
    close(masked_sum(x, mask), ref_masked_sum(x.tolist(), mask.tolist()))
    close(masked_mean(x, mask), ref_masked_mean(x.tolist(), mask.tolist()))


def test_masked_mean_empty_mask_is_zero() -> None:
    """An all-zero mask gives a mean of exactly 0, not NaN."""
    x = torch.randn(3, 4)
    out = masked_mean(x, torch.zeros(3, 4, dtype=torch.bool))
    assert not torch.isnan(out)
    assert out.item() == 0.0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("as_bool", [True, False])
def test_masked_whiten_matches_reference(seed: int, as_bool: bool) -> None:
    """masked_whiten = (x − μ)/sqrt(unbiased σ² + 1e-8) over valid elements, 0 elsewhere."""
    gen = torch.Generator().manual_seed(100 + seed)
    n, t = 6, 11
    x = torch.randn(n, t, generator=gen) * 3.0 + 1.5
    mask = random_mask(gen, n, t, as_bool=as_bool)
    out = masked_whiten(x, mask)
    close(out, ref_masked_whiten(x.tolist(), mask.tolist()))
    assert out.dtype == torch.float32
    assert torch.all(out[~mask.bool()] == 0.0)


def test_masked_whiten_statistics_of_output() -> None:
    """Whitened valid elements have mean 0 and unbiased std ≈ 1; padding values are ignored."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 8, generator=gen) * 4.0 - 2.0
    mask = random_mask(gen, 5, 8, allow_empty=False)
    x_garbage = x.clone()
    x_garbage[~mask] = 1e6
    out = masked_whiten(x_garbage, mask)
    valid = out[mask]
    torch.testing.assert_close(valid.mean(), torch.tensor(0.0), atol=1e-5, rtol=0)
    torch.testing.assert_close(valid.std(), torch.tensor(1.0), atol=1e-4, rtol=0)
    torch.testing.assert_close(out, masked_whiten(x, mask), atol=1e-6, rtol=1e-6)


def test_masked_whiten_epsilon_convention() -> None:
    """Hand example: x = [1, 3] → μ = 2, σ² = 2 (unbiased), out = ±1/sqrt(2 + 1e-8)."""
    x = torch.tensor([[1.0, 3.0, 100.0]])
    mask = torch.tensor([[True, True, False]])
    d = 1.0 / math.sqrt(2.0 + 1e-8)
    close(masked_whiten(x, mask), [[-d, d, 0.0]], atol=1e-7, rtol=1e-7)
    # A large eps shows it sits inside the square root: 1/sqrt(2 + 2) = 0.5.
    close(masked_whiten(x, mask, eps=2.0), [[-0.5, 0.5, 0.0]], atol=1e-7, rtol=1e-7)


def test_masked_whiten_constant_and_single_element() -> None:
    """Constant values or a single valid element whiten to 0 with no NaN."""
    x = torch.full((2, 3), 0.7)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    out = masked_whiten(x, mask)
    assert torch.isfinite(out).all()
    close(out, [[0.0] * 3, [0.0] * 3], atol=1e-4, rtol=0)
    single = torch.tensor([[True, False, False], [False, False, False]])
    out = masked_whiten(torch.randn(2, 3), single)
    assert torch.isfinite(out).all()
    assert torch.all(out == 0.0)


@pytest.mark.parametrize("seed", SEEDS)
def test_group_reductions_match_reference(seed: int) -> None:
    """group_count / group_mean / group_std equal per-group loops (std unbiased, G=1 → 0)."""
    gen = torch.Generator().manual_seed(200 + seed)
    num_groups = 6
    gi = random_group_index(gen, num_groups)
    values = torch.randn(gi.numel(), generator=gen) * 2.0
    gl, vl = gi.tolist(), values.tolist()
    close(group_count(gi, num_groups), ref_group_count(gl, num_groups))
    close(group_mean(values, gi, num_groups), ref_group_mean(vl, gl, num_groups))
    close(group_std(values, gi, num_groups), ref_group_std(vl, gl, num_groups))


def test_group_std_matches_torch_std_per_group() -> None:
    """group_std equals torch.std (unbiased, N − 1) of each group's values."""
    gen = torch.Generator().manual_seed(11)
    gi = random_group_index(gen, 8, max_size=9)
    values = torch.randn(gi.numel(), generator=gen)
    out = group_std(values, gi, 8)
    for g in range(8):
        vals = values[gi == g]
        expected = vals.std() if vals.numel() > 1 else torch.tensor(0.0)
        torch.testing.assert_close(out[g], expected, atol=1e-6, rtol=1e-5)


def test_group_reductions_empty_group_and_singleton() -> None:
    """An id with no members has count 0, mean 0, std 0; a singleton has std 0, not NaN."""
    gi = torch.tensor([0, 2, 0], dtype=torch.int64)
    values = torch.tensor([1.0, 5.0, 3.0])
    close(group_count(gi, 3), [2.0, 0.0, 1.0])
    close(group_mean(values, gi, 3), [2.0, 0.0, 5.0])
    close(group_std(values, gi, 3), [math.sqrt(2.0), 0.0, 0.0])
