"""The importance correction every algorithm applies to stale behaviour data:
`importance_weights` (tis truncates w at C, mask drops tokens with w > C, none ignores w) and
what each mode does inside the policy loss, including the denominator convention of the mask
mode (rejected tokens still count) and padding whose w overflows.
References: `tests.unit.algorithms.loss_reference`.
"""

from __future__ import annotations

import math

import pytest
import torch

from streamrl.algorithms.policy_losses import pg_loss, ppo_policy_loss
from tests.unit.algorithms.loss_reference import (
    AGGREGATIONS,
    IMPORTANCE,
    TOL,
    as_leaf,
    close,
    correction,
    global_counts,
    importance_weights,
    metrics_finite,
    random_batch,
    ref_kwargs,
    ref_masked_mean,
    ref_policy,
    ref_weights,
    run_policy,
)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", IMPORTANCE)
def test_importance_weights_match_reference(seed, mode):
    """w, the narrowed mask and the IS metrics equal the per-token rule on random data."""
    b = random_batch(seed)
    prox = as_leaf(b["logp_prox"])  # w must be detached even when logp_prox carries grad
    w, mask, metrics = importance_weights(prox, b["logp_behav"], b["mask"], mode, 2.0)
    assert not w.requires_grad
    px, bh, m = b["logp_prox"].tolist(), b["logp_behav"].tolist(), b["mask"].tolist()
    ref_w, ref_m, raw, over = [], [], [], []
    for i in range(len(px)):
        rows = [ref_weights(px[i][t], bh[i][t], m[i][t], mode, 2.0) for t in range(len(px[i]))]
        ref_w.append([r[0] for r in rows])
        ref_m.append([r[1] for r in rows])
        raw.append([r[2] for r in rows])
        over.append([1.0 if mode != "none" and r[2] > 2.0 else 0.0 for r in rows])
    close(mask, ref_m)
    # w only matters where the token counts (the narrowed mask); outside it must be finite.
    assert torch.isfinite(w).all()
    ref_w_masked = [
        [a * c for a, c in zip(r, mr, strict=True)] for r, mr in zip(ref_w, ref_m, strict=True)
    ]
    close(w * mask, ref_w_masked)
    close(metrics["actor/is_weight_mean"], ref_masked_mean(ref_w, ref_m))  # as applied, kept
    close(metrics["actor/is_clip_frac"], ref_masked_mean(over, m))


def test_importance_weights_tis_cap_hand_example():
    """w = [0.5, 1, 3, 10], C = 2: tis truncates, mask drops, none ignores; is_clip_frac counts
    the raw weights over the cap, is_weight_mean the weights applied to the kept tokens."""
    raw = [0.5, 1.0, 3.0, 10.0]
    prox = torch.full((1, 4), -1.0)
    behav = prox - torch.log(torch.tensor([raw]))
    mask = torch.ones(1, 4)
    w, m, metrics = importance_weights(prox, behav, mask, "tis", 2.0)
    close(w, [[0.5, 1.0, 2.0, 2.0]])
    close(m, [[1.0, 1.0, 1.0, 1.0]])
    close(metrics["actor/is_clip_frac"], 0.5)
    close(metrics["actor/is_weight_mean"], (0.5 + 1 + 2 + 2) / 4)  # not the raw 3.625
    w, m, metrics = importance_weights(prox, behav, mask, "mask", 2.0)
    close(m, [[1.0, 1.0, 0.0, 0.0]])
    close(metrics["actor/is_weight_mean"], (0.5 + 1) / 2)  # over the kept tokens
    close(w[:, :2], [[0.5, 1.0]])  # w itself unchanged by the mask mode
    w, m, metrics = importance_weights(prox, behav, mask, "none", 2.0)
    close(w, [[1.0, 1.0, 1.0, 1.0]])
    close(m, [[1.0, 1.0, 1.0, 1.0]])
    close(metrics["actor/is_clip_frac"], 0.0)  # none truncates nothing


@pytest.mark.parametrize("mode", IMPORTANCE)
def test_importance_weights_on_policy_is_one(mode):
    """logp_behav=None means w = 1 in every mode, nothing masked, is_clip_frac 0."""
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w, m, metrics = importance_weights(torch.randn(1, 3), None, mask, mode, 2.0)
    close(w, [[1.0, 1.0, 1.0]])
    close(m, mask.tolist())
    close(metrics["actor/is_weight_mean"], 1.0)
    close(metrics["actor/is_clip_frac"], 0.0)


def test_importance_weights_rejects_unknown_mode():
    """An unknown importance mode raises ValueError."""
    with pytest.raises(ValueError, match=r"unknown algorithm\.importance\.mode .clip."):
        importance_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "clip", 2.0)


@pytest.mark.parametrize("importance", IMPORTANCE)
def test_ppo_tis_cap_hand_example(importance):
    """r = 1, A = 1, w = [0.5, 1, 3, 10], C = 2, global count 4: ℓ = −w per kept token."""
    raw = [0.5, 1.0, 3.0, 10.0]
    prox = torch.full((1, 4), -1.0)
    behav = prox - torch.log(torch.tensor([raw]))
    logp = prox.clone().requires_grad_(True)
    loss, metrics = ppo_policy_loss(
        logp,
        prox,
        behav,
        torch.ones(1, 4),
        torch.ones(1, 4),
        correction=correction(importance),
        num_tokens=4,
    )
    loss.backward()
    weights = {"tis": [0.5, 1.0, 2.0, 2.0], "mask": [0.5, 1.0, 0.0, 0.0], "none": [1.0] * 4}
    w = weights[importance]
    close(loss, -sum(w) / 4)
    close(logp.grad, [[-x / 4 for x in w]])  # r = 1: ∂ℓ/∂logp = −w·A
    close(metrics["actor/is_clip_frac"], 0.0 if importance == "none" else 0.5)  # none: no cap
    kept = [x for x in w if x != 0.0]
    close(metrics["actor/is_weight_mean"], sum(kept) / len(kept))


@pytest.mark.parametrize("importance", IMPORTANCE)
@pytest.mark.parametrize("kind", ["ppo", "pg"])
def test_policy_loss_on_policy_behaviour_is_weight_one(importance, kind):
    """logp_behav=None gives exactly the loss of w = 1 (importance 'none')."""
    b = random_batch(7)
    loss, grad, metrics = run_policy(kind, b, importance=importance, logp_behav=None)
    ref_loss, ref_grad, _ = ref_policy(
        b["logp"], b["logp_prox"], None, b["advantages"], b["mask"], kind=kind, importance="none"
    )
    close(loss, ref_loss)
    close(grad, ref_grad)
    close(metrics["actor/is_weight_mean"], 1.0)
    close(metrics["actor/is_clip_frac"], 0.0)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("kind", ["ppo", "pg"])
def test_mask_mode_rejected_tokens_stay_in_denominator(aggregation, kind):
    """Module-docstring convention: IS-masked tokens add 0 to the numerator but still count.

    One response, tokens w = 1 and w = e⁵ > C, A = 1, r = 1 (logp = −1): ppo ℓ = [−1, dropped]
    → loss = −1 / 2 (not −1 / 1); pg ℓ = −w·A·logp = [1, dropped] → 1 / 2.
    """
    prox = torch.full((1, 2), -1.0)
    behav = torch.tensor([[-1.0, -6.0]])
    logp = prox.clone().requires_grad_(True)
    fn = ppo_policy_loss if kind == "ppo" else pg_loss
    loss, _ = fn(
        logp, prox, behav, torch.ones(1, 2), torch.ones(1, 2), correction=correction("mask"),
        aggregation=aggregation,
    )  # fmt: skip
    loss.backward()
    close(loss, -0.5 if kind == "ppo" else 0.5)
    close(logp.grad, [[-0.5, 0.0]])


def test_mask_mode_fully_rejected_response_still_counts_as_a_response():
    """seq-mean-token-mean, mask mode: a response whose tokens are all IS-rejected still counts.

    Responses: [w=1, w=1] with ℓ = −1 each and [w=e⁵] (rejected) → (−1 + 0) / 2 = −0.5.
    """
    prox = torch.full((2, 2), -1.0)
    behav = torch.tensor([[-1.0, -1.0], [-6.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, _ = ppo_policy_loss(
        prox.clone(), prox, behav, torch.ones(2, 2), mask, correction=correction("mask"),
        aggregation="seq-mean-token-mean",
    )  # fmt: skip
    close(loss, -0.5)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_mask_mode_with_global_counts_follows_convention(aggregation):
    """With the original counts passed as globals, IS-rejected tokens still count everywhere.

    For seq-mean-token-mean that includes each response's own token count.
    """
    b = random_batch(11)
    counts = global_counts(b["mask"])
    num_seqs = (
        counts["num_seqs_nonempty"]
        if aggregation == "seq-mean-token-mean"
        else counts["num_seqs_all"]
    )
    kwargs = {
        "importance": "mask",
        "aggregation": aggregation,
        "num_tokens": counts["num_tokens"],
        "num_seqs": num_seqs,
    }
    loss, grad, _ = run_policy("ppo", b, **kwargs)
    ref_loss, ref_grad, _ = ref_policy(**b, **ref_kwargs(kwargs))
    close(loss, ref_loss)
    close(grad, ref_grad)


def test_mask_mode_huge_rejected_weight_gives_no_nan():
    """mask mode drops a token with w = exp(100) (inf in fp32): the loss stays finite.

    Tokens: w = 1 (kept, ℓ = −1), w = e¹⁰⁰ (rejected). Global count 2 → loss −0.5.
    """
    prox = torch.full((1, 2), -1.0)
    behav = torch.tensor([[-1.0, -101.0]])
    logp = prox.clone().requires_grad_(True)
    loss, _ = ppo_policy_loss(
        logp,
        prox,
        behav,
        torch.ones(1, 2),
        torch.ones(1, 2),
        correction=correction("mask"),
        num_tokens=2,
    )
    loss.backward()
    close(loss, -0.5)
    close(logp.grad, [[-0.5, 0.0]])


@pytest.mark.parametrize("pad_behav", [-1e4, -math.inf])
@pytest.mark.parametrize("importance", IMPORTANCE)
def test_extreme_padding_values_do_not_leak(pad_behav, importance):
    """Padding holding logp_behav = −1e4 / −inf (w overflows) leaves loss and metrics finite."""
    b = random_batch(34)
    pad = b["mask"] == 0
    extreme = dict(b)
    extreme["logp_behav"] = torch.where(
        pad, torch.full_like(pad, pad_behav, dtype=torch.float32), b["logp_behav"]
    )
    loss, grad, metrics = run_policy("ppo", extreme, importance=importance)
    ref_loss, ref_grad, _ = run_policy("ppo", b, importance=importance)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    torch.testing.assert_close(grad, ref_grad, **TOL)
    assert metrics_finite(metrics), metrics
