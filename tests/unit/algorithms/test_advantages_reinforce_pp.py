"""REINFORCE++ and REINFORCE++-baseline (`streamrl.algorithms.reinforce_pp`): the whitened
reward-to-go of −β·KL_t plus the outcome reward on the last token, against a loop reference,
hand examples and masked rows; and whitening over a 2-rank gloo process group, which must
equal whitening the concatenated batch in one process.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from streamrl.algorithms.advantages import reinforce_pp_advantages
from streamrl.algorithms.masked import masked_whiten
from tests.unit.algorithms.advantage_reference import (
    SEEDS,
    close,
    group_members,
    random_group_index,
    random_mask,
    random_rewards,
    ref_masked_whiten,
)


def ref_reinforce_pp(
    rewards: list[float],
    mask: list[list[float]],
    kl: list[list[float]] | None,
    beta: float,
    group_index: list[int] | None = None,
) -> list[list[float]]:
    """REINFORCE++(-baseline): r_t = −β·KL_t (+ R_i at the last valid token), reward-to-go
    with γ = 1, whitened over every valid token of the batch."""
    if group_index is not None:
        members = group_members(group_index)
        rewards = [
            rewards[i] - statistics.fmean(rewards[j] for j in members[g])
            for i, g in enumerate(group_index)
        ]
    returns = []
    for i in range(len(mask)):
        T = len(mask[i])
        valid = [t for t in range(T) if mask[i][t]]
        r = [0.0] * T
        for t in valid:
            r[t] = -beta * kl[i][t] if kl is not None else 0.0
        if valid:
            r[max(valid)] += rewards[i]
        row = []
        for t in range(T):
            row.append(sum(r[k] for k in range(t, T) if mask[i][k]) if mask[i][t] else 0.0)
        returns.append(row)
    return ref_masked_whiten(returns, mask, eps=1e-8)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_reinforce_pp_matches_reference(seed: int, beta: float) -> None:
    """REINFORCE++ = whitened reward-to-go of (−β·KL_t + R_i at the last token)."""
    gen = torch.Generator().manual_seed(900 + seed)
    n, t = 8, 10
    rewards = random_rewards(gen, n, "binary" if seed % 2 else "continuous")
    mask = random_mask(gen, n, t, as_bool=bool(seed % 2))
    kl = torch.rand(n, t, generator=gen) * 0.5
    kl[~mask.bool()] = 123.0  # padding KL must not leak into the returns
    out = reinforce_pp_advantages(rewards, mask, kl, beta)
    assert out.dtype == torch.float32
    expected = ref_reinforce_pp(rewards.tolist(), mask.tolist(), kl.tolist(), beta)
    close(out, expected)


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_pp_baseline_matches_reference(seed: int) -> None:
    """REINFORCE++-baseline subtracts the group mean reward, then whitens over the batch."""
    gen = torch.Generator().manual_seed(950 + seed)
    gi = random_group_index(gen, 5)
    n, t = gi.numel(), 8
    rewards = random_rewards(gen, n, "binary")
    mask = random_mask(gen, n, t)
    kl = torch.rand(n, t, generator=gen) * 0.3
    out = reinforce_pp_advantages(
        rewards, mask, kl, 0.05, baseline=True, group_index=gi, num_groups=5
    )
    expected = ref_reinforce_pp(rewards.tolist(), mask.tolist(), kl.tolist(), 0.05, gi.tolist())
    close(out, expected)


def test_reinforce_pp_baseline_requires_groups() -> None:
    """baseline=True without group_index/num_groups raises ValueError."""
    with pytest.raises(ValueError, match="group_index"):
        reinforce_pp_advantages(torch.ones(2), torch.ones(2, 3), baseline=True)


def test_reinforce_pp_hand_example() -> None:
    """Hand example, β = 0.5: returns [[1−0.5·(.2+.4), 1−0.5·.4], [−0.5·.2 − 1]] then whiten."""
    rewards = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    kl = torch.tensor([[0.2, 0.4], [0.2, 9.0]])
    returns = [0.7, 0.8, -1.1]
    mu = sum(returns) / 3
    var = sum((x - mu) ** 2 for x in returns) / 2
    d = math.sqrt(var + 1e-8)
    expected = [[(0.7 - mu) / d, (0.8 - mu) / d], [(-1.1 - mu) / d, 0.0]]
    close(reinforce_pp_advantages(rewards, mask, kl, 0.5), expected, atol=1e-6, rtol=1e-6)


def test_reinforce_pp_fully_masked_rows_do_not_perturb() -> None:
    """Fully masked rows give zeros (no NaN) and leave every other row's advantages unchanged."""
    gen = torch.Generator().manual_seed(17)
    rewards = torch.randn(4, generator=gen)
    mask = random_mask(gen, 4, 6, allow_empty=False)
    kl = torch.rand(4, 6, generator=gen)
    base = reinforce_pp_advantages(rewards, mask, kl, 0.1)
    rewards_x = torch.cat([rewards, torch.tensor([5.0, -3.0])])
    mask_x = torch.cat([mask, torch.zeros(2, 6, dtype=torch.bool)])
    kl_x = torch.cat([kl, torch.full((2, 6), 7.0)])
    out = reinforce_pp_advantages(rewards_x, mask_x, kl_x, 0.1)
    assert torch.isfinite(out).all()
    assert torch.all(out[4:] == 0.0)
    torch.testing.assert_close(out[:4], base, atol=1e-6, rtol=1e-6)


def test_reinforce_pp_length_one_responses() -> None:
    """All responses of length 1: advantage = whitened R (unbiased std, eps 1e-8 inside sqrt)."""
    rewards = torch.tensor([1.0, -1.0, 1.0, 0.0])
    mask = torch.tensor([[1, 0, 0], [1, 0, 0], [1, 0, 0], [1, 0, 0]], dtype=torch.bool)
    mu = 0.25
    var = sum((r - mu) ** 2 for r in [1.0, -1.0, 1.0, 0.0]) / 3
    d = math.sqrt(var + 1e-8)
    expected = [[(r - mu) / d, 0.0, 0.0] for r in [1.0, -1.0, 1.0, 0.0]]
    close(reinforce_pp_advantages(rewards, mask), expected, atol=1e-6, rtol=1e-6)


def _dist_worker(rank: int, world_size: int, init_file: str, data_path: str, out_dir: str):
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        data = torch.load(data_path)
        sl = slice(*data["slices"][rank])
        pg = dist.group.WORLD
        x, mask = data["x"][sl], data["mask"][sl]
        rewards, kl, gi = data["rewards"][sl], data["kl"][sl], data["gi"][sl]
        gi_local = gi - gi.min()
        ng_local = int(gi_local.max().item()) + 1
        out = {
            "whiten": masked_whiten(x, mask, process_group=pg),
            "rpp": reinforce_pp_advantages(rewards, mask, kl, 0.1, process_group=pg),
            "rpp_base": reinforce_pp_advantages(
                rewards,
                mask,
                kl,
                0.1,
                baseline=True,
                group_index=gi_local,
                num_groups=ng_local,
                process_group=pg,
            ),
        }
        torch.save(out, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_whitening_over_process_group_equals_concatenated_batch(tmp_path) -> None:
    """With a 2-rank gloo group, each rank's masked_whiten / REINFORCE++(-baseline) output
    equals whitening the concatenated batch in one process (and the looped reference)."""
    gen = torch.Generator().manual_seed(2024)
    n, t = 10, 7
    x = torch.randn(n, t, generator=gen) * 2.0 + 1.0
    # Ragged masks so the two halves hold different token counts; one empty row on rank 1.
    lengths = torch.tensor([7, 1, 3, 5, 2, 6, 0, 4, 7, 1])
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    rewards = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0, 0.5, -1.0, 1.0, 1.0, -1.0])
    kl = torch.rand(n, t, generator=gen)
    gi = torch.tensor([0, 1, 0, 1, 1, 2, 3, 2, 3, 3], dtype=torch.int64)  # groups within ranks
    slices = [(0, 5), (5, 10)]
    data_path = tmp_path / "data.pt"
    torch.save(
        {"x": x, "mask": mask, "rewards": rewards, "kl": kl, "gi": gi, "slices": slices}, data_path
    )
    mp.spawn(
        _dist_worker,
        args=(2, str(tmp_path / "rendezvous"), str(data_path), str(tmp_path)),
        nprocs=2,
        join=True,
    )
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    got = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}

    whole = {
        "whiten": masked_whiten(x, mask),
        "rpp": reinforce_pp_advantages(rewards, mask, kl, 0.1),
        "rpp_base": reinforce_pp_advantages(
            rewards, mask, kl, 0.1, baseline=True, group_index=gi, num_groups=4
        ),
    }
    for key in whole:
        torch.testing.assert_close(got[key], whole[key], atol=1e-6, rtol=1e-6)
    ml, kll = mask.tolist(), kl.tolist()
    close(got["whiten"], ref_masked_whiten(x.tolist(), ml))
    close(got["rpp"], ref_reinforce_pp(rewards.tolist(), ml, kll, 0.1))
    close(got["rpp_base"], ref_reinforce_pp(rewards.tolist(), ml, kll, 0.1, gi.tolist()))
    # Whitening each half on its own would differ: the test can tell global from local.
    local = masked_whiten(x[:5], mask[:5])
    assert not torch.allclose(local, got["whiten"][:5], atol=1e-3)
