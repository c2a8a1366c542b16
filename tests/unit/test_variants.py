"""The framework guide's advantage variants (`streamrl.algorithms.variants`, ALGORITHMS.md
"Framework-guide variants") against references written here as plain loops over groups and
responses: weighted baselines (uniform, 1/√|o|, confidence; with and without the std), rank
advantages with ties, hierarchical advantages over optimiser batches, sequence-level weights;
edge cases: a group of one, G differing across groups, a response without sampled tokens."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from streamrl.algorithms.advantages import dr_grpo_advantages, grpo_advantages
from streamrl.algorithms.variants import (
    hierarchical_advantages,
    rank_advantages,
    sequence_length_weights,
    weighted_baseline_advantages,
)
from streamrl.learner.mini_batches import _median

# Groups of 4, 1, 3 and 5 responses, not contiguous; ties in group 0 and group 3.
GROUP_INDEX = [0, 2, 0, 1, 3, 2, 0, 3, 3, 2, 0, 3, 3]
REWARDS = [1.0, -1.0, 1.0, 0.5, 0.0, 2.0, -1.0, 0.0, 1.0, 0.5, 0.25, 0.0, -2.0]
LENGTHS = [5, 9, 1, 4, 0, 16, 25, 7, 3, 2, 8, 11, 6]
MEAN_LOGP = [-0.1, -2.0, -0.5, -1.0, 0.0, -0.2, -3.0, -0.7, -0.05, -1.5, -0.9, -0.3, -2.5]


def groups():
    members: dict[int, list[int]] = {}
    for i, g in enumerate(GROUP_INDEX):
        members.setdefault(g, []).append(i)
    return members


def tensors():
    return torch.tensor(REWARDS), torch.tensor(GROUP_INDEX), 4


def ref_weighted(weights: str, std_eps: float | None) -> list[float]:
    out = [0.0] * len(REWARDS)
    for members in groups().values():
        if weights == "uniform":
            q = dict.fromkeys(members, 1.0)
        elif weights == "inv_sqrt_len":
            q = {i: 1.0 / math.sqrt(max(LENGTHS[i], 1)) for i in members}
        else:
            q = {i: math.exp(MEAN_LOGP[i]) for i in members}
        baseline = sum(q[i] * REWARDS[i] for i in members) / sum(q.values())
        values = [REWARDS[i] for i in members]
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        for i in members:
            a = REWARDS[i] - baseline
            if std_eps is not None:
                a = a / (std + std_eps) if len(set(values)) > 1 else 0.0
            out[i] = a
    return out


@pytest.mark.parametrize("weights", ["uniform", "inv_sqrt_len", "confidence"])
@pytest.mark.parametrize("std_eps", [None, 1e-6])
def test_weighted_baselines_match_the_reference(weights, std_eps):
    rewards, index, n = tensors()
    got = weighted_baseline_advantages(
        rewards, index, n, weights=weights, lengths=torch.tensor(LENGTHS, dtype=torch.float32),
        mean_logp_behav=torch.tensor(MEAN_LOGP), std_eps=std_eps,
    )  # fmt: skip
    assert got.tolist() == pytest.approx(ref_weighted(weights, std_eps), abs=1e-5)
    assert got[3].item() == 0.0  # the group of one


def test_the_uniform_baseline_is_the_papers_advantage():
    rewards, index, n = tensors()
    kwargs = {"weights": "uniform", "lengths": torch.ones(13), "mean_logp_behav": torch.zeros(13)}
    dr = weighted_baseline_advantages(rewards, index, n, **kwargs)
    grpo = weighted_baseline_advantages(rewards, index, n, std_eps=1e-6, **kwargs)
    torch.testing.assert_close(dr, dr_grpo_advantages(rewards, index, n))
    torch.testing.assert_close(grpo, grpo_advantages(rewards, index, n, eps=1e-6))


def ref_rank() -> list[float]:
    out = [0.0] * len(REWARDS)
    for members in groups().values():
        size = len(members)
        for i in members:
            below = sum(1 for j in members if REWARDS[j] < REWARDS[i])
            tied = sum(1 for j in members if REWARDS[j] == REWARDS[i])
            rank = below + (tied + 1) / 2  # the mean of ranks below+1 .. below+tied
            out[i] = (rank - (size + 1) / 2) / (size / 2)
    return out


def test_rank_advantages_match_the_reference_with_ties():
    got = rank_advantages(*tensors())
    assert got.tolist() == pytest.approx(ref_rank(), abs=1e-6)
    assert got[3].item() == 0.0  # a group of one
    assert got[4].item() == got[7].item() == got[11].item()  # three tied zeros
    for members in groups().values():  # centred in every group
        assert sum(got[i].item() for i in members) == pytest.approx(0.0, abs=1e-6)


def test_rank_advantages_of_random_groups_match_the_reference():
    gen = torch.Generator().manual_seed(3)
    index = torch.randint(0, 7, (60,), generator=gen)
    rewards = torch.randint(-2, 3, (60,), generator=gen).float()
    got = rank_advantages(rewards, index, 7).tolist()
    for i in range(60):
        members = [j for j in range(60) if index[j] == index[i]]
        below = sum(1 for j in members if rewards[j] < rewards[i])
        tied = sum(1 for j in members if rewards[j] == rewards[i])
        size = len(members)
        expected = (below + (tied + 1) / 2 - (size + 1) / 2) / (size / 2)
        assert got[i] == pytest.approx(expected, abs=1e-6)


def test_hierarchical_advantages_blend_group_and_optimiser_batch_baselines():
    rewards, index, n = tensors()
    batch = [0 if g in (0, 1) else 1 for g in GROUP_INDEX]  # two optimiser batches
    got = hierarchical_advantages(rewards, index, n, torch.tensor(batch), 0.7)
    for i, r in enumerate(REWARDS):
        group = [REWARDS[j] for j in range(13) if GROUP_INDEX[j] == GROUP_INDEX[i]]
        same_batch = [REWARDS[j] for j in range(13) if batch[j] == batch[i]]
        expected = 0.7 * (r - sum(group) / len(group)) + 0.3 * (
            r - sum(same_batch) / len(same_batch)
        )
        assert got[i].item() == pytest.approx(expected, abs=1e-6)


def test_sequence_weights_follow_the_median_and_spare_empty_responses():
    lengths = torch.tensor([4.0, 16.0, 0.0, 8.0])
    median = torch.full((4,), 8.0)
    got = sequence_length_weights(lengths, median, 0.5)
    assert got.tolist() == pytest.approx([math.sqrt(2), math.sqrt(0.5), 1.0, 1.0])
    assert sequence_length_weights(lengths, median, 0.0).tolist() == [1.0] * 4


@pytest.mark.parametrize("values", [[3.0], [5.0, 1.0], [4.0, 1.0, 9.0], [2.0, 8.0, 4.0, 6.0]])
def test_the_median_is_the_statistics_median(values):
    assert _median(torch.tensor(values)) == statistics.median(values)
    assert _median(torch.tensor([])) == 0.0
