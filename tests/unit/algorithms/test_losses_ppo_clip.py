"""`ppo_policy_loss`, the clipped surrogate of GRPO, Dr. GRPO, DAPO (Clip-Higher), RLOO,
REINFORCE++ and VAPO, with the dual clip: loss, gradient and metrics against the loop
reference, the clipped branches' exactly-zero gradient, and one update per batch
(logp_prox = logp.detach()). References: `tests.unit.algorithms.loss_reference`.
"""

from __future__ import annotations

import math

import pytest
import torch

from streamrl.algorithms.policy_losses import ppo_policy_loss
from tests.unit.algorithms.loss_reference import (
    AGGREGATIONS,
    IMPORTANCE,
    as_leaf,
    close,
    correction,
    random_batch,
    ref_aggregate,
    ref_kwargs,
    ref_policy,
    run_policy,
)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("importance", IMPORTANCE)
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_ppo_loss_matches_reference(seed, aggregation, importance, dual_clip):
    """Loss, gradient and all metrics equal the loop reference (default denominators)."""
    b = random_batch(seed)
    kwargs = {
        "clip_low": 0.2,
        "clip_high": 0.28,
        "dual_clip": dual_clip,
        "importance": importance,
        "importance_cap": 2.0,
        "aggregation": aggregation,
    }
    loss, grad, metrics = run_policy("ppo", b, **kwargs)
    ref_loss, ref_grad, ref_metrics = ref_policy(**b, **ref_kwargs(kwargs))
    close(loss, ref_loss)
    close(grad, ref_grad)
    assert set(ref_metrics) <= set(metrics)
    for key, value in ref_metrics.items():
        close(metrics[key], value)


@pytest.mark.parametrize("seed", [3, 4])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("importance", IMPORTANCE)
def test_ppo_loss_matches_reference_with_global_counts(seed, aggregation, importance):
    """With explicit num_tokens / num_seqs / max_len the loss uses exactly those denominators."""
    b = random_batch(seed, N=5, T=6)
    kwargs = {
        "dual_clip": 10.0,
        "importance": importance,
        "aggregation": aggregation,
        "num_tokens": 23.0,
        "num_seqs": 9,
        "max_len": 13,
    }
    loss, grad, metrics = run_policy("ppo", b, **kwargs)
    ref_loss, ref_grad, _ = ref_policy(**b, **ref_kwargs(kwargs))
    close(loss, ref_loss)
    close(grad, ref_grad)
    close(metrics["actor/pg_loss"], ref_loss)


def test_ppo_clip_and_dual_clip_hand_example():
    """Far-out ratios: the clipped / dual-clip branches give exactly zero gradient, others not.

    ε_low 0.2, ε_high 0.28, c 3, w = 1. Per token (r, A) → ℓ, ∂ℓ/∂logp:
    (20, +1) → −1.28, 0 (clip); (0.01, +1) → −0.01, −0.01; (0.01, −1) → 0.8, 0 (clip);
    (1.5, −1) → 1.5, 1.5; (100, −1) → 3, 0 (dual clip); (1.1, +1) → −1.1, −1.1;
    (0.9, −1) → 0.9, 0.9.
    """
    ratios = [20.0, 0.01, 0.01, 1.5, 100.0, 1.1, 0.9]
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0, 1.0, -1.0]])
    prox = torch.full((1, 7), -2.0)
    logp = (prox + torch.log(torch.tensor([ratios]))).requires_grad_(True)
    loss, metrics = ppo_policy_loss(
        logp, prox, None, adv, torch.ones(1, 7), dual_clip=3.0, correction=correction("none")
    )
    loss.backward()
    per_token = [-1.28, -0.01, 0.8, 1.5, 3.0, -1.1, 0.9]
    grads = [0.0, -0.01, 0.0, 1.5, 0.0, -1.1, 0.9]
    close(loss, sum(per_token) / 7)
    close(logp.grad, [[g / 7 for g in grads]])
    zero = torch.tensor([[True, False, True, False, True, False, False]])
    assert torch.all(logp.grad[zero] == 0.0)  # exactly zero, not merely small
    assert torch.all(logp.grad[~zero] != 0.0)
    close(metrics["actor/clip_frac"], 2 / 7)
    close(metrics["actor/dual_clip_frac"], 1 / 7)


def test_ppo_without_dual_clip_keeps_large_negative_loss():
    """Without dual clip, A < 0 with r = 100 gives ℓ = −r·A = 100 and gradient −A·r ≠ 0."""
    prox = torch.full((1, 1), -3.0)
    logp = (prox + math.log(100.0)).requires_grad_(True)
    loss, metrics = ppo_policy_loss(logp, prox, None, -torch.ones(1, 1), torch.ones(1, 1))
    loss.backward()
    close(loss, 100.0)
    close(logp.grad, [[100.0]])
    close(metrics["actor/dual_clip_frac"], 0.0)
    close(metrics["actor/clip_frac"], 0.0)


@pytest.mark.parametrize("seed", [0, 1])
def test_ppo_gradient_zero_exactly_where_clipping_active(seed):
    """On random far-off-policy tokens, ∂loss/∂logp is exactly 0 iff a clip is active."""
    gen = torch.Generator().manual_seed(50 + seed)
    N, T = 8, 16
    prox = -2.0 * torch.rand(N, T, generator=gen) - 0.1
    log_r = 2.5 * torch.randn(N, T, generator=gen)  # many ratios far outside the clip range
    adv = torch.randn(N, T, generator=gen)
    logp = (prox + log_r).requires_grad_(True)
    loss, metrics = ppo_policy_loss(
        logp, prox, None, adv, torch.ones(N, T), clip_low=0.2, clip_high=0.28, dual_clip=3.0
    )
    loss.backward()
    r = torch.exp(log_r)
    clip_pos = (adv > 0) & (r > 1.28)
    clip_neg = (adv < 0) & (r < 0.8)
    dual = (adv < 0) & (r > 3.0)
    active = clip_pos | clip_neg | dual
    assert 0 < int(active.sum()) < N * T
    assert torch.all(logp.grad[active] == 0.0)
    assert torch.all(logp.grad[~active] != 0.0)
    close(metrics["actor/clip_frac"], float((clip_pos | clip_neg).float().mean()))
    close(metrics["actor/dual_clip_frac"], float(dual.float().mean()))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("importance", ["tis", "none"])
def test_ppo_with_detached_prox_is_plain_policy_gradient(seed, aggregation, importance):
    """With logp_prox = logp.detach(), r = 1, no clipping, and ∇ = −w·A·∇logp / denominator."""
    b = random_batch(seed)
    logp = as_leaf(b["logp"])
    loss, metrics = ppo_policy_loss(
        logp, logp.detach(), b["logp_behav"], b["advantages"], b["mask"],
        dual_clip=3.0, correction=correction(importance), aggregation=aggregation,
    )  # fmt: skip
    loss.backward()
    lp, bh, adv, m = (b[k].tolist() for k in ("logp", "logp_behav", "advantages", "mask"))
    per_token, grad_per_token = [], []
    for i in range(len(lp)):
        row_l, row_g = [], []
        for t in range(len(lp[i])):
            w = min(math.exp(lp[i][t] - bh[i][t]), 2.0) if importance == "tis" else 1.0
            row_l.append(-w * adv[i][t])
            row_g.append(-w * adv[i][t])
        per_token.append(row_l)
        grad_per_token.append(row_g)
    ref_loss, scale = ref_aggregate(per_token, m, m, aggregation)
    ref_grad = [
        [s * g for s, g in zip(srow, grow, strict=True)]
        for srow, grow in zip(scale, grad_per_token, strict=True)
    ]
    close(loss, ref_loss)
    close(logp.grad, ref_grad)
    close(metrics["actor/clip_frac"], 0.0)
    close(metrics["actor/dual_clip_frac"], 0.0)
    close(metrics["actor/ppo_kl"], 0.0)
