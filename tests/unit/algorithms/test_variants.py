"""The framework guide's advantage variants (`streamrl.algorithms.variants`, docs/algorithms.md
"Framework-guide variants") against references written here as plain loops over groups and
responses: weighted baselines (uniform, 1/√|o|, confidence; with and without the std), rank
advantages with ties, hierarchical advantages over optimiser batches, sequence-level weights,
temporal groups and their reward history;
edge cases: a group of one, G differing across groups, a response without sampled tokens."""

from __future__ import annotations

import json
import math
import statistics
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from streamrl.algorithms.advantages import dr_grpo_advantages, grpo_advantages
from streamrl.algorithms.variants import (
    hierarchical_advantages,
    rank_advantages,
    sequence_length_weights,
    temporal_advantages,
    weighted_baseline_advantages,
)
from streamrl.learner.mini_batches import _median
from streamrl.learner.reward_history import RewardHistory

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


# -- temporal groups (Alg. 5) ----------------------------------------------------------------

PAST = {0: [0.0, 0.5], 1: [1.5, -0.5, 1.0], 3: [0.0]}  # group 2 has no past


def ref_temporal(std_eps: float | None) -> list[float]:
    out = [0.0] * len(REWARDS)
    for g, members in groups().items():
        pooled = [REWARDS[i] for i in members] + PAST.get(g, [])
        mean = sum(pooled) / len(pooled)
        std = statistics.stdev(pooled) if len(pooled) > 1 else 0.0
        for i in members:
            a = REWARDS[i] - mean
            if std_eps is not None:
                a = a / (std + std_eps) if len(set(pooled)) > 1 else 0.0
            out[i] = a
    return out


@pytest.mark.parametrize("std_eps", [None, 1e-6])
def test_temporal_advantages_pool_the_prompts_past_rewards(std_eps):
    rewards, index, n = tensors()
    past = [(g, r) for g, values in sorted(PAST.items(), reverse=True) for r in values]
    got = temporal_advantages(
        rewards, index, n, torch.tensor([r for _, r in past]), torch.tensor([g for g, _ in past]),
        std_eps,
    )  # fmt: skip
    assert got.tolist() == pytest.approx(ref_temporal(std_eps), abs=1e-5)
    assert got[3].item() != 0.0  # a group of one has a baseline once it has a past


def test_temporal_advantages_without_a_past_are_the_papers_bitwise():
    rewards, index, n = tensors()
    none = torch.zeros(0), torch.zeros(0, dtype=torch.long)
    assert torch.equal(
        temporal_advantages(rewards, index, n, *none), dr_grpo_advantages(*tensors())
    )
    assert torch.equal(
        temporal_advantages(rewards, index, n, *none, 1e-6), grpo_advantages(*tensors(), eps=1e-6)
    )


def _group(prompt: str, rewards: list[float], version: int):
    return SimpleNamespace(prompt_id=prompt, rewards=np.array(rewards, np.float32),
                           policy_version=version)  # fmt: skip


def test_the_reward_history_keeps_the_last_h_of_at_most_max_age_versions():
    history = RewardHistory(depth=3, max_age=2)
    assert history.past([_group("a", [1.0], 0)], 0).rewards.numel() == 0
    history.record([_group("a", [1.0, 0.0], 0), _group("b", [0.5], 0)], learner_version=0)
    history.record([_group("a", [-1.0, 1.0], 1)], learner_version=1)
    past = history.past([_group("b", [0], 2), _group("a", [0], 2), _group("c", [0], 2)], 2)
    assert past.rewards.tolist() == [0.5, 0.0, -1.0, 1.0]  # a: the last 3, oldest first
    assert past.group.tolist() == [0, 1, 1, 1]
    # At version 3 the rewards sampled at version 0 are 3 versions old: no longer pooled.
    assert history.past([_group("b", [0], 3), _group("a", [0], 3)], 3).rewards.tolist() == [
        -1.0, 1.0,
    ]  # fmt: skip
    history.record([], learner_version=3)  # and forgotten
    assert history.rewards == {"a": [(1, -1.0), (1, 1.0)]}


def test_the_reward_history_round_trips_through_json_exactly_and_checks_its_record():
    history = RewardHistory(depth=4, max_age=5)
    rewards = np.random.default_rng(0).standard_normal(6).astype(np.float32)
    history.record([_group("p", rewards.tolist(), 7)], 7)
    record = json.loads(json.dumps(history.to_record()))
    again = RewardHistory.from_record(record, depth=4, max_age=5)
    assert again == history
    assert np.array_equal(again.past([_group("p", [0], 7)], 7).rewards.numpy(), rewards[-4:])
    assert RewardHistory.from_record(record, depth=2, max_age=5).rewards["p"] == history.rewards[
        "p"
    ][-2:]  # fmt: skip
    with pytest.raises(ValueError, match="malformed"):
        RewardHistory.from_record([1, 2], depth=4, max_age=5)
    with pytest.raises(ValueError, match=r"holds \['x', 1.0\] for prompt 'p'"):
        RewardHistory.from_record({"rewards": {"p": [["x", 1.0]]}}, depth=4, max_age=5)
