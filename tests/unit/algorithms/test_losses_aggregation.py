"""How per-token losses become one number: `aggregate`'s three modes (token-mean as in
DAPO, seq-mean-token-mean as in GRPO, seq-mean-token-sum-norm as in Dr. GRPO), micro-batches
that share the optimiser batch's global denominators, and masked, empty and length-1 rows.
References: `tests.unit.algorithms.loss_reference`.
"""

from __future__ import annotations

import pytest
import torch

from streamrl.algorithms.losses import aggregate
from streamrl.algorithms.policy_losses import pg_loss, ppo_policy_loss
from tests.unit.algorithms.loss_reference import (
    AGGREGATIONS,
    IMPORTANCE,
    TOL,
    as_leaf,
    close,
    correction,
    global_counts,
    metrics_finite,
    ragged_mask,
    random_batch,
    ref_aggregate,
    ref_policy,
    run_policy,
)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("explicit", [False, True])
def test_aggregate_matches_loop_reference(seed, mode, explicit):
    """aggregate equals the loop formula, with default and with passed global counts."""
    gen = torch.Generator().manual_seed(100 + seed)
    N, T = 5, 6
    mask = ragged_mask(gen, N, T)
    loss = torch.randn(N, T, generator=gen)
    kwargs = {}
    if explicit:
        kwargs = {"num_tokens": 17.0, "num_seqs": 7, "max_len": 11}
    got = aggregate(loss, mask, mode, **kwargs)
    ref, _ = ref_aggregate(loss.tolist(), mask.tolist(), mask.tolist(), mode, **kwargs)
    close(got, ref)


def test_aggregate_hand_example():
    """Hand-derived values of the three aggregations on a 2×3 batch."""
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    close(aggregate(loss, mask, "token-mean"), (1 + 2 + 3 + 4) / 4)
    close(aggregate(loss, mask, "seq-mean-token-mean"), (2.0 + 4.0) / 2)
    close(aggregate(loss, mask, "seq-mean-token-sum-norm"), 10.0 / (2 * 3))
    close(aggregate(loss, mask, "seq-mean-token-sum-norm", num_seqs=4, max_len=5), 10.0 / 20)
    close(aggregate(loss, mask, "token-mean", num_tokens=torch.tensor(8.0)), 10.0 / 8)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregate_all_masked_is_zero(mode):
    """An all-masked batch aggregates to exactly 0 (not NaN), with a zero gradient."""
    loss = torch.randn(3, 4).requires_grad_(True)
    got = aggregate(loss, torch.zeros(3, 4), mode)
    got.backward()
    assert got.item() == 0.0
    assert torch.equal(loss.grad, torch.zeros(3, 4))


def test_aggregate_rejects_unknown_mode():
    """An unknown aggregation name raises ValueError."""
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "token-sum")


def test_length_one_response_among_longer_ones():
    """seq-mean-token-mean weights a 1-token response like a long one (hand example)."""
    loss_t = torch.tensor([[2.0, 4.0, 6.0], [10.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    close(aggregate(loss_t, mask, "seq-mean-token-mean"), (4.0 + 10.0) / 2)
    close(aggregate(loss_t, mask, "token-mean"), 22.0 / 4)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("kind", ["ppo", "pg"])
@pytest.mark.parametrize("importance", ["tis", "none"])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_micro_batches_with_global_counts_sum_to_full_batch(
    aggregation, kind, importance, as_tensor
):
    """Σ micro-batch losses (global counts) = full-batch loss; accumulated grads match too.

    Micro-batches are trimmed to their own longest response, so `max_len` must carry L_max.
    """
    b = random_batch(21, N=8, T=9)
    fn = ppo_policy_loss if kind == "ppo" else pg_loss
    extra = {"dual_clip": 3.0} if kind == "ppo" else {}
    full_logp = as_leaf(b["logp"])
    full_loss, _ = fn(
        full_logp, b["logp_prox"], b["logp_behav"], b["advantages"], b["mask"],
        correction=correction(importance), aggregation=aggregation, **extra,
    )  # fmt: skip
    full_loss.backward()

    mask = b["mask"]
    num_tokens = mask.sum()
    num_seqs = (mask.sum(-1) > 0).sum() if aggregation == "seq-mean-token-mean" else mask.shape[0]
    if not as_tensor:
        num_tokens, num_seqs = float(num_tokens), int(num_seqs)
    logp = as_leaf(b["logp"])
    total = 0.0
    for rows in (slice(0, 3), slice(3, 5), slice(5, 8)):
        T_mb = max(int(mask[rows].sum(-1).max()), 1)
        part = {k: v[rows, :T_mb] for k, v in b.items()}
        loss, _ = fn(
            logp[rows, :T_mb], part["logp_prox"], part["logp_behav"], part["advantages"],
            part["mask"], correction=correction(importance), aggregation=aggregation,
            num_tokens=num_tokens, num_seqs=num_seqs, max_len=mask.shape[1], **extra,
        )  # fmt: skip
        loss.backward()
        total += loss.item()
    torch.testing.assert_close(torch.tensor(total), full_loss.detach(), **TOL)
    torch.testing.assert_close(logp.grad, full_logp.grad, **TOL)


def test_micro_batches_mask_mode_with_global_counts():
    """mask mode: micro-batches with the original global token count reproduce the reference."""
    b = random_batch(22, N=8, T=9)
    counts = global_counts(b["mask"])
    ref_loss, ref_grad, _ = ref_policy(
        **b, importance="mask", aggregation="token-mean", num_tokens=counts["num_tokens"]
    )
    logp = as_leaf(b["logp"])
    total = 0.0
    for rows in (slice(0, 4), slice(4, 8)):
        loss, _ = ppo_policy_loss(
            logp[rows], b["logp_prox"][rows], b["logp_behav"][rows], b["advantages"][rows],
            b["mask"][rows], correction=correction("mask"), num_tokens=counts["num_tokens"],
        )  # fmt: skip
        loss.backward()
        total += loss.item()
    close(torch.tensor(total), ref_loss)
    close(logp.grad, ref_grad)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("kind", ["ppo", "pg"])
def test_fully_masked_rows_contribute_nothing(aggregation, kind):
    """Empty responses with garbage values change neither the loss nor other gradients."""
    b = random_batch(31, N=6, T=5, min_len=1)
    garbage = random_batch(32, N=6, T=5)
    empty = torch.tensor([False, True, False, False, True, False])
    padded = {k: torch.where(empty.unsqueeze(1), 4.0 * garbage[k], v) for k, v in b.items()}
    padded["mask"] = b["mask"] * (~empty).float().unsqueeze(1)
    kept = {k: v[~empty] for k, v in b.items()}
    extra = {"num_seqs": 6} if aggregation == "seq-mean-token-sum-norm" else {}
    loss_p, grad_p, metrics = run_policy(kind, padded, aggregation=aggregation, **extra)
    loss_k, grad_k, _ = run_policy(kind, kept, aggregation=aggregation, **extra)
    torch.testing.assert_close(loss_p, loss_k, **TOL)
    torch.testing.assert_close(grad_p[~empty], grad_k, **TOL)
    assert torch.equal(grad_p[empty], torch.zeros_like(grad_p[empty]))
    assert metrics_finite(metrics)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("kind", ["ppo", "pg"])
@pytest.mark.parametrize("importance", IMPORTANCE)
def test_all_masked_batch_gives_zero_loss(aggregation, kind, importance):
    """An all-masked batch: loss exactly 0, zero gradient, finite metrics (no NaN)."""
    b = random_batch(33, N=3, T=4)
    b["mask"] = torch.zeros(3, 4)
    loss, grad, metrics = run_policy(kind, b, aggregation=aggregation, importance=importance)
    assert loss.item() == 0.0
    assert torch.equal(grad, torch.zeros(3, 4))
    assert metrics_finite(metrics)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("kind", ["ppo", "pg"])
def test_length_one_responses(seed, aggregation, kind):
    """T = 1 responses match the reference; token-mean equals seq-mean-token-mean there."""
    b = random_batch(40 + seed, N=5, T=1, min_len=1)
    loss, grad, _ = run_policy(kind, b, aggregation=aggregation, dual_clip=3.0)
    ref_loss, ref_grad, _ = ref_policy(
        **b, kind=kind, aggregation=aggregation, dual_clip=3.0 if kind == "ppo" else None
    )
    close(loss, ref_loss)
    close(grad, ref_grad)
    if aggregation == "seq-mean-token-mean":
        other, _, _ = run_policy(kind, b, aggregation="token-mean", dual_clip=3.0)
        torch.testing.assert_close(loss, other, **TOL)
