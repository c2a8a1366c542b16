"""The learner's tensor packing (`streamrl.learner.mini_batches`): batch tensors, mini/micro-batch
packing, rank sharding. References are written independently here (plain loops over
groups/tokens)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from storage.stream.records import ScoredGroup
from streamrl.algorithms import aggregate
from streamrl.learner.mini_batches import MicroBatch, TrainBatch, make_mini_batches, shard_for_rank
from tests.stream_data import random_group

VOCAB = 1000


def _group(rng, i: int, version: int = 0, **kwargs) -> ScoredGroup:
    kwargs = {"vocab": VOCAB, "prompt_len": int(rng.integers(1, 9)), **kwargs}
    return random_group(rng, prompt_id=f"p{i}", policy_version=version, **kwargs)


def _groups(n: int, seed: int = 0, **kwargs) -> list[ScoredGroup]:
    rng = np.random.default_rng(seed)
    return [_group(rng, i, **kwargs) for i in range(n)]


def _mixed_groups(n: int = 6, seed: int = 6) -> list[ScoredGroup]:
    rng = np.random.default_rng(seed)
    return [
        _group(rng, i, version=i % 3, group_size=int(rng.integers(1, 5)), min_len=0, max_len=20)
        for i in range(n)
    ]


def test_train_batch_holds_each_response_in_stream_order():
    groups = _mixed_groups()
    batch = TrainBatch.from_groups(groups)
    flat = [(g_i, g, i) for g_i, g in enumerate(groups) for i in range(g.group_size)]
    assert batch.group_index.tolist() == [g_i for g_i, _, _ in flat]
    assert batch.rewards.tolist() == [float(g.rewards[i]) for _, g, i in flat]
    assert batch.raw_scores.tolist() == [float(g.raw_scores[i]) for _, g, i in flat]
    assert batch.truncated.tolist() == [bool(g.truncated[i]) for _, g, i in flat]
    assert batch.policy_version.tolist() == [g.policy_version for _, g, _ in flat]
    assert batch.prompt_length.tolist() == [len(g.prompt_tokens) for _, g, _ in flat]
    assert batch.response_length.tolist() == [len(g.response_tokens[i]) for _, g, i in flat]
    assert batch.rewards.dtype == torch.float32
    assert batch.group_index.dtype == batch.policy_version.dtype == torch.int64


def _all_micro(mini_batches):
    return [m for mini in mini_batches for m in mini.micro_batches]


@pytest.mark.parametrize("budget", [28, 64, 1000])
def test_micro_batches_put_every_token_and_logprob_at_the_right_position(budget):
    groups = _mixed_groups()
    batch = TrainBatch.from_groups(groups)
    responses = [(g, i) for g in groups for i in range(g.group_size)]
    seen = []
    for micro in _all_micro(make_mini_batches(batch, 2, budget)):
        n, T = micro.input_ids.shape
        loss_tokens = 0
        assert micro.targets.shape == micro.loss_mask.shape == micro.behaviour_logprobs.shape
        assert micro.targets.shape == (n, T - 1)
        assert torch.equal(micro.targets, micro.input_ids[:, 1:])
        for r, s in enumerate(micro.sample_index.tolist()):
            g, i = responses[s]
            prompt, resp = g.prompt_tokens.tolist(), g.response_tokens[i].tolist()
            P, L = len(prompt), len(resp)
            assert micro.input_ids[r].tolist() == prompt + resp + [0] * (T - P - L)
            assert micro.attention_mask[r].tolist() == [1] * (P + L) + [0] * (T - P - L)
            for j in range(T - 1):
                in_response = P - 1 <= j <= P + L - 2
                assert bool(micro.loss_mask[r, j]) == in_response
                if in_response:
                    assert micro.targets[r, j] == resp[j - P + 1]
                    assert micro.behaviour_logprobs[r, j] == g.behaviour_logprobs[i][j - P + 1]
                else:
                    assert micro.behaviour_logprobs[r, j] == 0.0
            assert micro.group_index[r] == batch.group_index[s]
            seen.append(s)
            loss_tokens += L
        assert micro.num_tokens == loss_tokens
    assert sorted(seen) == list(range(len(responses)))


@pytest.mark.parametrize("budget", [28, 50, 200])
def test_mini_batches_hold_consecutive_groups_and_micro_batches_fit_the_budget(budget):
    groups = _mixed_groups(8)
    batch = TrainBatch.from_groups(groups)
    minis = make_mini_batches(batch, 2, budget)
    assert [list(m.groups) for m in minis] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    every_row = []
    for mini in minis:
        rows = [s for m in mini.micro_batches for s in m.sample_index.tolist()]
        assert sorted(rows) == mini.sample_index.tolist()
        assert {int(batch.group_index[s]) for s in rows} <= set(mini.groups)
        every_row += rows
        assert all(m.input_ids.numel() <= budget for m in mini.micro_batches)
        lengths = [int(batch.response_length[s]) for s in rows]
        assert mini.num_loss_tokens == sum(lengths) == sum(m.num_tokens for m in mini.micro_batches)
        assert mini.num_responses == len(rows)
        assert mini.num_scored_responses == sum(n > 0 for n in lengths)
    assert sorted(every_row) == list(range(batch.group_index.numel()))  # each exactly once


def test_the_budget_changes_the_packing_but_not_the_sequences_or_denominators():
    batch = TrainBatch.from_groups(_mixed_groups(8))
    small, large = make_mini_batches(batch, 4, 28), make_mini_batches(batch, 4, 500)
    for a, b in zip(small, large, strict=True):
        assert len(a.micro_batches) > len(b.micro_batches)
        rows_a = sorted(s for m in a.micro_batches for s in m.sample_index.tolist())
        rows_b = sorted(s for m in b.micro_batches for s in m.sample_index.tolist())
        assert rows_a == rows_b
        denominators = ("num_loss_tokens", "num_responses", "num_scored_responses")
        assert [getattr(a, d) for d in denominators] == [getattr(b, d) for d in denominators]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_micro_batch_losses_with_the_global_denominators_sum_to_the_mini_batch_loss(mode):
    groups = _mixed_groups(4)
    per_response = [lp.astype(np.float64) for g in groups for lp in g.behaviour_logprobs]
    if mode == "token-mean":  # the per-token "loss" is the behaviour log-prob itself
        expected = np.concatenate(per_response).mean()
    else:
        expected = np.mean([lp.mean() for lp in per_response if lp.size])
    batch = TrainBatch.from_groups(groups)
    for budget in (28, 90, 1000):
        (mini,) = make_mini_batches(batch, 4, budget)
        total = sum(
            aggregate(
                m.behaviour_logprobs,
                m.loss_mask,
                mode,
                num_tokens=mini.num_loss_tokens,
                num_seqs=mini.num_scored_responses,
            )
            for m in mini.micro_batches
        )
        assert float(total) == pytest.approx(expected, rel=1e-5)


def test_overlong_filter_removes_truncated_responses_from_the_loss_and_denominators():
    groups = [
        ScoredGroup(**{**g.__dict__, "truncated": np.arange(g.group_size) % 2 == 0})
        for g in _mixed_groups(4)
    ]
    batch = TrainBatch.from_groups(groups)
    (mini,) = make_mini_batches(batch, 4, 100, overlong_filter=True)
    kept = (~batch.truncated) & (batch.response_length > 0)
    assert mini.num_loss_tokens == int(batch.response_length[~batch.truncated].sum())
    assert mini.num_scored_responses == int(kept.sum())
    assert mini.num_responses == batch.group_index.numel()
    for micro in mini.micro_batches:
        assert not micro.loss_mask[batch.truncated[micro.sample_index]].any()


@pytest.mark.parametrize("world_size", [1, 2, 3, 7])
def test_rank_shards_have_equal_counts_and_cover_every_sequence_once(world_size):
    batch = TrainBatch.from_groups(_mixed_groups(6))
    (mini,) = make_mini_batches(batch, 6, 40)
    shards = [shard_for_rank(mini, r, world_size) for r in range(world_size)]
    assert len({len(s) for s in shards}) == 1
    assert len(shards[0]) == -(-len(mini.micro_batches) // world_size)
    real = [m for s in shards for m in s if not m.is_dummy]
    rows = sorted(s for m in real for s in m.sample_index.tolist())
    assert rows == list(range(batch.group_index.numel()))
    dummies = [m for s in shards for m in s if m.is_dummy]
    assert len(dummies) == world_size * len(shards[0]) - len(mini.micro_batches)
    assert all(m.num_tokens == 0 and not m.loss_mask.any() for m in dummies)
    again = [shard_for_rank(mini, r, world_size) for r in range(world_size)]
    assert [[m.sample_index.tolist() for m in s] for s in shards] == [
        [m.sample_index.tolist() for m in s] for s in again
    ]


def test_rank_shards_deal_the_largest_micro_batches_to_the_least_loaded_rank():
    rng = np.random.default_rng(7)
    sequence_lengths = [40, 38, 30, 28, 25, 22]  # each above half the budget: one per micro
    groups = [
        _group(rng, i, group_size=1, min_len=n - 4, max_len=n - 4, prompt_len=4)
        for i, n in enumerate(sequence_lengths)
    ]
    (mini,) = make_mini_batches(TrainBatch.from_groups(groups), 6, 40)
    assert [m.input_ids.numel() for m in mini.micro_batches] == sequence_lengths
    shards = [shard_for_rank(mini, r, 2) for r in range(2)]
    loads = [[m.input_ids.numel() for m in shard] for shard in shards]
    # 40→r0, 38→r1, 30→r1, 28→r0, 25→r0 (tie), 22→r1; alternating would give 95 / 88.
    assert loads == [[40, 28, 25], [38, 30, 22]]


def test_dummy_micro_batch_has_the_documented_layout():
    dummy = MicroBatch.dummy()
    assert dummy.input_ids.shape == (1, 2)
    assert dummy.targets.shape == dummy.loss_mask.shape == dummy.behaviour_logprobs.shape
    assert dummy.attention_mask.all()
    assert dummy.is_dummy


def test_packing_errors_name_the_setting_to_change():
    batch = TrainBatch.from_groups(_groups(4, max_len=30, prompt_len=10))
    longest = int(batch.seq_length.max())
    with pytest.raises(ValueError, match=r"learner\.micro_batch_tokens"):
        make_mini_batches(batch, 2, longest - 1)


@pytest.mark.parametrize(
    ("groups", "per_update", "expected"),
    [(8, 2, [2, 2, 2, 2]), (7, 3, [3, 2, 2]), (5, 2, [2, 2, 1]), (3, 4, [3]), (1, 2, [1])],
)
def test_a_batch_closed_early_splits_into_runs_as_even_as_possible(groups, per_update, expected):
    """A length-aware batch (learner.batch_tokens) may hold fewer groups than batch_groups:
    ⌈groups / mini_batch_groups⌉ updates of consecutive groups, sizes differing by ≤ 1."""
    batch = TrainBatch.from_groups(_mixed_groups(groups))
    minis = make_mini_batches(batch, per_update, 200)
    assert [len(m.groups) for m in minis] == expected
    assert [g for m in minis for g in m.groups] == list(range(groups))
    assert sum(m.num_responses for m in minis) == batch.group_index.numel()


@pytest.mark.parametrize("shared_prompt", [False, True])
@pytest.mark.parametrize("budget", [40, 64, 200])
def test_whole_groups_never_split_a_group_between_micro_batches(shared_prompt, budget):
    """A preference pair's loss needs both responses in one micro-batch, whatever the budget
    and whether the prompt is computed once."""
    rng = np.random.default_rng(3)
    groups = [_group(rng, i, group_size=2, min_len=1, max_len=16) for i in range(12)]
    batch = TrainBatch.from_groups(groups)
    (mini,) = make_mini_batches(batch, 12, budget, shared_prompt=shared_prompt, whole_groups=True)
    seen = []
    for micro in mini.micro_batches:
        rows = micro.input_ids.shape[0] * micro.input_ids.shape[1]
        assert rows <= budget or micro.input_ids.shape[0] <= 2  # a lone group may fill it
        counts = torch.bincount(micro.group_index, minlength=12)
        assert set(counts[counts > 0].tolist()) == {2}, "a group split between micro-batches"
        seen += micro.sample_index.tolist()
    assert sorted(seen) == list(range(24))
    # Without whole_groups a tight budget does split some group (the option is what holds them).
    if not shared_prompt and budget == 40:
        (split,) = make_mini_batches(batch, 12, budget)
        assert any(
            1 in torch.bincount(m.group_index, minlength=12).tolist() for m in split.micro_batches
        )
