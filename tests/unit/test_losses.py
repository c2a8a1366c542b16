"""Tests for `streamrl.algorithms.losses` against loop-based references from ALGORITHMS.md.

Every reference below works on Python floats, one sample and one token at a time, straight from
the formulas (per-token PPO / GPG loss, importance correction, the three aggregations with the
documented denominator convention for importance="mask"). Gradients w.r.t. logp are compared
with the hand-derived derivative: −w·A·r where the unclipped branch is taken, 0 where the
clipped or dual-clip branch is, −w·A for GPG, each scaled by the aggregation's denominator.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from streamrl.algorithms.losses import (
    aggregate,
    explained_variance,
    importance_weights,
    pg_loss,
    positive_nll_loss,
    ppo_policy_loss,
    value_loss,
)

AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
IMPORTANCE = ["tis", "mask", "none"]
TOL = {"atol": 1e-5, "rtol": 1e-5}


# ----------------------------------------------------------------------------------------------
# Helpers: random batches and loop-based references
# ----------------------------------------------------------------------------------------------


def _close(actual: Tensor, expected) -> None:
    """assert_close against a Python float / nested list computed by a reference."""
    expected_t = torch.tensor(expected, dtype=torch.float64).to(actual.dtype)
    torch.testing.assert_close(actual.detach(), expected_t, **TOL)


def _ragged_mask(gen: torch.Generator, N: int, T: int, min_len: int = 0) -> Tensor:
    """Right-padded 0/1 mask with random lengths; row 0 is full, row 1 empty when allowed."""
    lengths = torch.randint(min_len, T + 1, (N,), generator=gen)
    lengths[0] = T
    if min_len == 0 and N > 2:
        lengths[1] = 0
    return (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()


def _batch(seed: int, N: int = 6, T: int = 7, min_len: int = 0) -> dict[str, Tensor]:
    """Random policy-loss inputs; padded positions hold finite garbage that must not leak."""
    gen = torch.Generator().manual_seed(seed)
    mask = _ragged_mask(gen, N, T, min_len)
    logp_prox = -3.0 * torch.rand(N, T, generator=gen) - 0.05
    logp = logp_prox + 0.5 * torch.randn(N, T, generator=gen)
    logp_behav = logp_prox + 0.7 * torch.randn(N, T, generator=gen)
    advantages = torch.randn(N, T, generator=gen)
    pad = mask == 0
    logp = torch.where(pad, 3.0 * torch.randn(N, T, generator=gen), logp)
    logp_behav = torch.where(pad, -5.0 * torch.rand(N, T, generator=gen), logp_behav)
    advantages = torch.where(pad, 10.0 * torch.randn(N, T, generator=gen), advantages)
    return {
        "logp": logp,
        "logp_prox": logp_prox,
        "logp_behav": logp_behav,
        "advantages": advantages,
        "mask": mask,
    }


def _leaf(x: Tensor) -> Tensor:
    return x.detach().clone().requires_grad_(True)


def _ref_weights(prox: float, behav: float | None, m: float, importance: str, cap: float):
    """(w, numerator mask, raw w) for one token per the importance-correction rule."""
    raw = 1.0 if behav is None else math.exp(prox - behav)
    if importance == "tis":
        return min(raw, cap), m, raw
    if importance == "mask":
        return raw, (m if raw <= cap else 0.0), raw
    return 1.0, m, raw


def _ref_aggregate(values, keep, count_mask, mode, *, num_tokens=None, num_seqs=None, max_len=None):
    """Aggregate per-token values with loops.

    `keep` multiplies the numerator; `count_mask` defines the denominators (they differ only
    for importance="mask", whose rejected tokens stay in the denominator). Returns
    `(loss, scale)` with `scale[i][t]` = ∂loss/∂value[i][t].
    """
    N = len(values)
    T = len(values[0]) if N else 0
    scale = [[0.0] * T for _ in range(N)]
    if mode == "token-mean":
        denom = sum(sum(row) for row in count_mask) if num_tokens is None else float(num_tokens)
        denom = max(denom, 1.0)
        total = 0.0
        for i in range(N):
            for t in range(T):
                total += keep[i][t] * values[i][t]
                scale[i][t] = keep[i][t] / denom
        return total / denom, scale
    if mode == "seq-mean-token-mean":
        seq_means = []
        for i in range(N):
            n_i = sum(count_mask[i])
            s = 0.0
            for t in range(T):
                s += keep[i][t] * values[i][t]
            seq_means.append((s, max(n_i, 1.0), n_i > 0))
        S = sum(1 for *_, nonempty in seq_means if nonempty) if num_seqs is None else num_seqs
        S = max(float(S), 1.0)
        for i in range(N):
            for t in range(T):
                scale[i][t] = keep[i][t] / (seq_means[i][1] * S)
        return sum(s / n for s, n, _ in seq_means) / S, scale
    if mode == "seq-mean-token-sum-norm":
        S = N if num_seqs is None else num_seqs
        L = T if max_len is None else max_len
        denom = max(float(S), 1.0) * L
        total = 0.0
        for i in range(N):
            for t in range(T):
                total += keep[i][t] * values[i][t]
                scale[i][t] = keep[i][t] / denom
        return total / denom, scale
    raise AssertionError(mode)


def _masked_mean_ref(values, mask) -> float:
    num = 0.0
    den = 0.0
    for row_v, row_m in zip(values, mask, strict=True):
        for v, m in zip(row_v, row_m, strict=True):
            if m:
                num += v
                den += 1.0
    return num / max(den, 1.0)


def _ref_policy(
    logp,
    logp_prox,
    logp_behav,
    advantages,
    mask,
    *,
    kind="ppo",
    clip_low=0.2,
    clip_high=0.28,
    dual_clip=None,
    importance="tis",
    cap=2.0,
    aggregation="token-mean",
    num_tokens=None,
    num_seqs=None,
    max_len=None,
):
    """Loop reference for ppo_policy_loss / pg_loss: (loss, dloss/dlogp, metrics)."""
    lp, px, adv, m = (x.tolist() for x in (logp, logp_prox, advantages, mask))
    bh = None if logp_behav is None else logp_behav.tolist()
    N = len(lp)
    T = len(lp[0]) if N else 0
    per_token = [[0.0] * T for _ in range(N)]
    dper_token = [[0.0] * T for _ in range(N)]
    keep = [[0.0] * T for _ in range(N)]
    raw_w = [[0.0] * T for _ in range(N)]
    over = [[0.0] * T for _ in range(N)]
    clip_taken = [[0.0] * T for _ in range(N)]
    dual_taken = [[0.0] * T for _ in range(N)]
    log_ratio_neg = [[0.0] * T for _ in range(N)]
    for i in range(N):
        for t in range(T):
            behav = None if bh is None else bh[i][t]
            w, keep[i][t], raw_w[i][t] = _ref_weights(px[i][t], behav, m[i][t], importance, cap)
            over[i][t] = 1.0 if raw_w[i][t] > cap else 0.0
            a = adv[i][t]
            log_ratio_neg[i][t] = px[i][t] - lp[i][t]
            if kind == "pg":
                loss_t, dloss_t = -a * lp[i][t], -a
            else:
                r = math.exp(lp[i][t] - px[i][t])
                r_clip = min(max(r, 1.0 - clip_low), 1.0 + clip_high)
                if r_clip * a < r * a:  # min() takes the clipped objective: no gradient
                    loss_t, dloss_t = -r_clip * a, 0.0
                    clip_taken[i][t] = 1.0
                else:
                    loss_t, dloss_t = -r * a, -a * r
                if dual_clip is not None and a < 0 and loss_t > -dual_clip * a:
                    loss_t, dloss_t = -dual_clip * a, 0.0
                    dual_taken[i][t] = 1.0
            per_token[i][t] = w * loss_t
            dper_token[i][t] = w * dloss_t
    loss, scale = _ref_aggregate(
        per_token,
        keep,
        m,
        aggregation,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        max_len=max_len,
    )
    grad = [[scale[i][t] * dper_token[i][t] for t in range(T)] for i in range(N)]
    metrics = {
        "actor/pg_loss": loss,
        "actor/ppo_kl": _masked_mean_ref(log_ratio_neg, m),
        "actor/is_weight_mean": _masked_mean_ref(raw_w, m),
        "actor/is_clip_frac": _masked_mean_ref(over, m),
    }
    if kind == "ppo":
        metrics["actor/clip_frac"] = _masked_mean_ref(clip_taken, m)
        metrics["actor/dual_clip_frac"] = _masked_mean_ref(dual_taken, m)
    return loss, grad, metrics


def _run_policy(kind: str, b: dict[str, Tensor], **kwargs):
    """Call the implementation with a fresh leaf logp; return (loss, logp.grad, metrics)."""
    logp = _leaf(b["logp"])
    fn = ppo_policy_loss if kind == "ppo" else pg_loss
    if kind == "pg":
        for key in ("clip_low", "clip_high", "dual_clip"):
            kwargs.pop(key, None)
    behav = kwargs.pop("logp_behav", b["logp_behav"])
    loss, metrics = fn(logp, b["logp_prox"], behav, b["advantages"], b["mask"], **kwargs)
    loss.backward()
    return loss, logp.grad, metrics


def _ref_kwargs(kwargs: dict) -> dict:
    out = dict(kwargs)
    if "importance_cap" in out:
        out["cap"] = out.pop("importance_cap")
    return out


def _global_counts(mask: Tensor) -> dict[str, float]:
    return {
        "num_tokens": float(mask.sum()),
        "num_seqs_nonempty": float((mask.sum(-1) > 0).sum()),
        "num_seqs_all": float(mask.shape[0]),
    }


# ----------------------------------------------------------------------------------------------
# aggregate
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("explicit", [False, True])
def test_aggregate_matches_loop_reference(seed, mode, explicit):
    """aggregate equals the loop formula, with default and with passed global counts."""
    gen = torch.Generator().manual_seed(100 + seed)
    N, T = 5, 6
    mask = _ragged_mask(gen, N, T)
    loss = torch.randn(N, T, generator=gen)
    kwargs = {}
    if explicit:
        kwargs = {"num_tokens": 17.0, "num_seqs": 7, "max_len": 11}
    got = aggregate(loss, mask, mode, **kwargs)
    ref, _ = _ref_aggregate(loss.tolist(), mask.tolist(), mask.tolist(), mode, **kwargs)
    _close(got, ref)


def test_aggregate_hand_example():
    """Hand-derived values of the three aggregations on a 2×3 batch."""
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    _close(aggregate(loss, mask, "token-mean"), (1 + 2 + 3 + 4) / 4)
    _close(aggregate(loss, mask, "seq-mean-token-mean"), (2.0 + 4.0) / 2)
    _close(aggregate(loss, mask, "seq-mean-token-sum-norm"), 10.0 / (2 * 3))
    _close(aggregate(loss, mask, "seq-mean-token-sum-norm", num_seqs=4, max_len=5), 10.0 / 20)
    _close(aggregate(loss, mask, "token-mean", num_tokens=torch.tensor(8.0)), 10.0 / 8)


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


# ----------------------------------------------------------------------------------------------
# importance_weights
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", IMPORTANCE)
def test_importance_weights_match_reference(seed, mode):
    """w, the narrowed mask and the IS metrics equal the per-token rule on random data."""
    b = _batch(seed)
    prox = _leaf(b["logp_prox"])  # w must be detached even when logp_prox carries grad
    w, mask, metrics = importance_weights(prox, b["logp_behav"], b["mask"], mode, 2.0)
    assert not w.requires_grad
    px, bh, m = b["logp_prox"].tolist(), b["logp_behav"].tolist(), b["mask"].tolist()
    ref_w, ref_m, raw, over = [], [], [], []
    for i in range(len(px)):
        rows = [_ref_weights(px[i][t], bh[i][t], m[i][t], mode, 2.0) for t in range(len(px[i]))]
        ref_w.append([r[0] for r in rows])
        ref_m.append([r[1] for r in rows])
        raw.append([r[2] for r in rows])
        over.append([1.0 if r[2] > 2.0 else 0.0 for r in rows])
    _close(mask, ref_m)
    # w only matters where the token counts; outside it must still be finite.
    ref_w_masked = [
        [a * c for a, c in zip(r, mr, strict=True)] for r, mr in zip(ref_w, m, strict=True)
    ]
    _close(w * b["mask"], ref_w_masked)
    _close(metrics["actor/is_weight_mean"], _masked_mean_ref(raw, m))
    _close(metrics["actor/is_clip_frac"], _masked_mean_ref(over, m))


def test_importance_weights_tis_cap_hand_example():
    """w = [0.5, 1, 3, 10], C = 2: tis truncates, mask drops, none ignores; metrics use raw w."""
    raw = [0.5, 1.0, 3.0, 10.0]
    prox = torch.full((1, 4), -1.0)
    behav = prox - torch.log(torch.tensor([raw]))
    mask = torch.ones(1, 4)
    w, m, metrics = importance_weights(prox, behav, mask, "tis", 2.0)
    _close(w, [[0.5, 1.0, 2.0, 2.0]])
    _close(m, [[1.0, 1.0, 1.0, 1.0]])
    _close(metrics["actor/is_clip_frac"], 0.5)
    _close(metrics["actor/is_weight_mean"], sum(raw) / 4)
    w, m, _ = importance_weights(prox, behav, mask, "mask", 2.0)
    _close(m, [[1.0, 1.0, 0.0, 0.0]])
    _close(w[:, :2], [[0.5, 1.0]])  # w itself unchanged by the mask mode
    w, m, metrics = importance_weights(prox, behav, mask, "none", 2.0)
    _close(w, [[1.0, 1.0, 1.0, 1.0]])
    _close(m, [[1.0, 1.0, 1.0, 1.0]])
    _close(metrics["actor/is_clip_frac"], 0.5)


@pytest.mark.parametrize("mode", IMPORTANCE)
def test_importance_weights_on_policy_is_one(mode):
    """logp_behav=None means w = 1 in every mode, nothing masked, is_clip_frac 0."""
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w, m, metrics = importance_weights(torch.randn(1, 3), None, mask, mode, 2.0)
    _close(w, [[1.0, 1.0, 1.0]])
    _close(m, mask.tolist())
    _close(metrics["actor/is_weight_mean"], 1.0)
    _close(metrics["actor/is_clip_frac"], 0.0)


def test_importance_weights_rejects_unknown_mode():
    """An unknown importance mode raises ValueError."""
    with pytest.raises(ValueError, match="unknown importance mode"):
        importance_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "clip", 2.0)


# ----------------------------------------------------------------------------------------------
# ppo_policy_loss and pg_loss against the loop reference
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("importance", IMPORTANCE)
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_ppo_loss_matches_reference(seed, aggregation, importance, dual_clip):
    """Loss, gradient and all metrics equal the loop reference (default denominators)."""
    b = _batch(seed)
    kwargs = {
        "clip_low": 0.2,
        "clip_high": 0.28,
        "dual_clip": dual_clip,
        "importance": importance,
        "importance_cap": 2.0,
        "aggregation": aggregation,
    }
    loss, grad, metrics = _run_policy("ppo", b, **kwargs)
    ref_loss, ref_grad, ref_metrics = _ref_policy(**b, **_ref_kwargs(kwargs))
    _close(loss, ref_loss)
    _close(grad, ref_grad)
    assert set(ref_metrics) <= set(metrics)
    for key, value in ref_metrics.items():
        _close(metrics[key], value)


@pytest.mark.parametrize("seed", [3, 4])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("importance", IMPORTANCE)
def test_ppo_loss_matches_reference_with_global_counts(seed, aggregation, importance):
    """With explicit num_tokens / num_seqs / max_len the loss uses exactly those denominators."""
    b = _batch(seed, N=5, T=6)
    kwargs = {
        "dual_clip": 10.0,
        "importance": importance,
        "aggregation": aggregation,
        "num_tokens": 23.0,
        "num_seqs": 9,
        "max_len": 13,
    }
    loss, grad, metrics = _run_policy("ppo", b, **kwargs)
    ref_loss, ref_grad, _ = _ref_policy(**b, **_ref_kwargs(kwargs))
    _close(loss, ref_loss)
    _close(grad, ref_grad)
    _close(metrics["actor/pg_loss"], ref_loss)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("importance", IMPORTANCE)
def test_pg_loss_matches_reference(seed, aggregation, importance):
    """GPG loss ℓ = −w·A·logp_θ: loss, gradient −w·A/denominator and metrics match."""
    b = _batch(seed)
    kwargs = {"importance": importance, "importance_cap": 2.0, "aggregation": aggregation}
    loss, grad, metrics = _run_policy("pg", b, **kwargs)
    ref_loss, ref_grad, ref_metrics = _ref_policy(**b, kind="pg", **_ref_kwargs(kwargs))
    _close(loss, ref_loss)
    _close(grad, ref_grad)
    for key, value in ref_metrics.items():
        _close(metrics[key], value)


def test_pg_loss_hand_example():
    """ℓ = −w·A·logp with w from tis: hand-computed token-mean and gradient."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    prox = torch.tensor([[-1.0, -2.0, -0.5]])
    behav = prox - torch.log(torch.tensor([[1.0, 0.5, 4.0]]))  # w = 1, 0.5, 4 → capped to 2
    adv = torch.tensor([[2.0, -1.0, 1.0]])
    loss, _ = pg_loss(logp, prox, behav, adv, torch.ones(1, 3), importance="tis")
    loss.backward()
    expected = (-1.0 * 2.0 * -1.0 + -0.5 * -1.0 * -2.0 + -2.0 * 1.0 * -0.5) / 3
    _close(loss, expected)
    _close(logp.grad, [[-2.0 / 3, 0.5 / 3, -2.0 / 3]])


# ----------------------------------------------------------------------------------------------
# Clipping, dual clip and gradient masking
# ----------------------------------------------------------------------------------------------


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
        logp, prox, None, adv, torch.ones(1, 7), dual_clip=3.0, importance="none"
    )
    loss.backward()
    per_token = [-1.28, -0.01, 0.8, 1.5, 3.0, -1.1, 0.9]
    grads = [0.0, -0.01, 0.0, 1.5, 0.0, -1.1, 0.9]
    _close(loss, sum(per_token) / 7)
    _close(logp.grad, [[g / 7 for g in grads]])
    zero = torch.tensor([[True, False, True, False, True, False, False]])
    assert torch.all(logp.grad[zero] == 0.0)  # exactly zero, not merely small
    assert torch.all(logp.grad[~zero] != 0.0)
    _close(metrics["actor/clip_frac"], 2 / 7)
    _close(metrics["actor/dual_clip_frac"], 1 / 7)


def test_ppo_without_dual_clip_keeps_large_negative_loss():
    """Without dual clip, A < 0 with r = 100 gives ℓ = −r·A = 100 and gradient −A·r ≠ 0."""
    prox = torch.full((1, 1), -3.0)
    logp = (prox + math.log(100.0)).requires_grad_(True)
    loss, metrics = ppo_policy_loss(logp, prox, None, -torch.ones(1, 1), torch.ones(1, 1))
    loss.backward()
    _close(loss, 100.0)
    _close(logp.grad, [[100.0]])
    _close(metrics["actor/dual_clip_frac"], 0.0)
    _close(metrics["actor/clip_frac"], 0.0)


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
    _close(metrics["actor/clip_frac"], float((clip_pos | clip_neg).float().mean()))
    _close(metrics["actor/dual_clip_frac"], float(dual.float().mean()))


# ----------------------------------------------------------------------------------------------
# Importance correction inside the policy loss
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("importance", IMPORTANCE)
def test_ppo_tis_cap_hand_example(importance):
    """r = 1, A = 1, w = [0.5, 1, 3, 10], C = 2, global count 4: ℓ = −w per kept token."""
    raw = [0.5, 1.0, 3.0, 10.0]
    prox = torch.full((1, 4), -1.0)
    behav = prox - torch.log(torch.tensor([raw]))
    logp = prox.clone().requires_grad_(True)
    loss, metrics = ppo_policy_loss(
        logp, prox, behav, torch.ones(1, 4), torch.ones(1, 4), importance=importance, num_tokens=4
    )
    loss.backward()
    weights = {"tis": [0.5, 1.0, 2.0, 2.0], "mask": [0.5, 1.0, 0.0, 0.0], "none": [1.0] * 4}
    w = weights[importance]
    _close(loss, -sum(w) / 4)
    _close(logp.grad, [[-x / 4 for x in w]])  # r = 1: ∂ℓ/∂logp = −w·A
    _close(metrics["actor/is_clip_frac"], 0.5)
    _close(metrics["actor/is_weight_mean"], sum(raw) / 4)


@pytest.mark.parametrize("importance", IMPORTANCE)
@pytest.mark.parametrize("kind", ["ppo", "pg"])
def test_policy_loss_on_policy_behaviour_is_weight_one(importance, kind):
    """logp_behav=None gives exactly the loss of w = 1 (importance 'none')."""
    b = _batch(7)
    loss, grad, metrics = _run_policy(kind, b, importance=importance, logp_behav=None)
    ref_loss, ref_grad, _ = _ref_policy(
        b["logp"], b["logp_prox"], None, b["advantages"], b["mask"], kind=kind, importance="none"
    )
    _close(loss, ref_loss)
    _close(grad, ref_grad)
    _close(metrics["actor/is_weight_mean"], 1.0)
    _close(metrics["actor/is_clip_frac"], 0.0)


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
        logp, prox, behav, torch.ones(1, 2), torch.ones(1, 2), importance="mask",
        aggregation=aggregation,
    )  # fmt: skip
    loss.backward()
    _close(loss, -0.5 if kind == "ppo" else 0.5)
    _close(logp.grad, [[-0.5, 0.0]])


def test_mask_mode_fully_rejected_response_still_counts_as_a_response():
    """seq-mean-token-mean, mask mode: a response whose tokens are all IS-rejected still counts.

    Responses: [w=1, w=1] with ℓ = −1 each and [w=e⁵] (rejected) → (−1 + 0) / 2 = −0.5.
    """
    prox = torch.full((2, 2), -1.0)
    behav = torch.tensor([[-1.0, -1.0], [-6.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, _ = ppo_policy_loss(
        prox.clone(), prox, behav, torch.ones(2, 2), mask, importance="mask",
        aggregation="seq-mean-token-mean",
    )  # fmt: skip
    _close(loss, -0.5)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_mask_mode_with_global_counts_follows_convention(aggregation):
    """With the original counts passed as globals, IS-rejected tokens still count everywhere.

    For seq-mean-token-mean that includes each response's own token count.
    """
    b = _batch(11)
    counts = _global_counts(b["mask"])
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
    loss, grad, _ = _run_policy("ppo", b, **kwargs)
    ref_loss, ref_grad, _ = _ref_policy(**b, **_ref_kwargs(kwargs))
    _close(loss, ref_loss)
    _close(grad, ref_grad)


def test_mask_mode_huge_rejected_weight_gives_no_nan():
    """mask mode drops a token with w = exp(100) (inf in fp32): the loss stays finite.

    Tokens: w = 1 (kept, ℓ = −1), w = e¹⁰⁰ (rejected). Global count 2 → loss −0.5.
    """
    prox = torch.full((1, 2), -1.0)
    behav = torch.tensor([[-1.0, -101.0]])
    logp = prox.clone().requires_grad_(True)
    loss, _ = ppo_policy_loss(
        logp, prox, behav, torch.ones(1, 2), torch.ones(1, 2), importance="mask", num_tokens=2
    )
    loss.backward()
    _close(loss, -0.5)
    _close(logp.grad, [[-0.5, 0.0]])


# ----------------------------------------------------------------------------------------------
# One update per batch: logp_prox = logp.detach()
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("importance", ["tis", "none"])
def test_ppo_with_detached_prox_is_plain_policy_gradient(seed, aggregation, importance):
    """With logp_prox = logp.detach(), r = 1, no clipping, and ∇ = −w·A·∇logp / denominator."""
    b = _batch(seed)
    logp = _leaf(b["logp"])
    loss, metrics = ppo_policy_loss(
        logp, logp.detach(), b["logp_behav"], b["advantages"], b["mask"],
        dual_clip=3.0, importance=importance, aggregation=aggregation,
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
    ref_loss, scale = _ref_aggregate(per_token, m, m, aggregation)
    ref_grad = [
        [s * g for s, g in zip(srow, grow, strict=True)]
        for srow, grow in zip(scale, grad_per_token, strict=True)
    ]
    _close(loss, ref_loss)
    _close(logp.grad, ref_grad)
    _close(metrics["actor/clip_frac"], 0.0)
    _close(metrics["actor/dual_clip_frac"], 0.0)
    _close(metrics["actor/ppo_kl"], 0.0)


# ----------------------------------------------------------------------------------------------
# Micro-batches with global denominators
# ----------------------------------------------------------------------------------------------


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
    b = _batch(21, N=8, T=9)
    fn = ppo_policy_loss if kind == "ppo" else pg_loss
    extra = {"dual_clip": 3.0} if kind == "ppo" else {}
    full_logp = _leaf(b["logp"])
    full_loss, _ = fn(
        full_logp, b["logp_prox"], b["logp_behav"], b["advantages"], b["mask"],
        importance=importance, aggregation=aggregation, **extra,
    )  # fmt: skip
    full_loss.backward()

    mask = b["mask"]
    num_tokens = mask.sum()
    num_seqs = (mask.sum(-1) > 0).sum() if aggregation == "seq-mean-token-mean" else mask.shape[0]
    if not as_tensor:
        num_tokens, num_seqs = float(num_tokens), int(num_seqs)
    logp = _leaf(b["logp"])
    total = 0.0
    for rows in (slice(0, 3), slice(3, 5), slice(5, 8)):
        T_mb = max(int(mask[rows].sum(-1).max()), 1)
        part = {k: v[rows, :T_mb] for k, v in b.items()}
        loss, _ = fn(
            logp[rows, :T_mb], part["logp_prox"], part["logp_behav"], part["advantages"],
            part["mask"], importance=importance, aggregation=aggregation,
            num_tokens=num_tokens, num_seqs=num_seqs, max_len=mask.shape[1], **extra,
        )  # fmt: skip
        loss.backward()
        total += loss.item()
    torch.testing.assert_close(torch.tensor(total), full_loss.detach(), **TOL)
    torch.testing.assert_close(logp.grad, full_logp.grad, **TOL)


def test_micro_batches_mask_mode_with_global_counts():
    """mask mode: micro-batches with the original global token count reproduce the reference."""
    b = _batch(22, N=8, T=9)
    counts = _global_counts(b["mask"])
    ref_loss, ref_grad, _ = _ref_policy(
        **b, importance="mask", aggregation="token-mean", num_tokens=counts["num_tokens"]
    )
    logp = _leaf(b["logp"])
    total = 0.0
    for rows in (slice(0, 4), slice(4, 8)):
        loss, _ = ppo_policy_loss(
            logp[rows], b["logp_prox"][rows], b["logp_behav"][rows], b["advantages"][rows],
            b["mask"][rows], importance="mask", num_tokens=counts["num_tokens"],
        )  # fmt: skip
        loss.backward()
        total += loss.item()
    _close(torch.tensor(total), ref_loss)
    _close(logp.grad, ref_grad)


# ----------------------------------------------------------------------------------------------
# Masked rows, empty batches, length-1 responses
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("kind", ["ppo", "pg"])
def test_fully_masked_rows_contribute_nothing(aggregation, kind):
    """Empty responses with garbage values change neither the loss nor other gradients."""
    b = _batch(31, N=6, T=5, min_len=1)
    garbage = _batch(32, N=6, T=5)
    empty = torch.tensor([False, True, False, False, True, False])
    padded = {k: torch.where(empty.unsqueeze(1), 4.0 * garbage[k], v) for k, v in b.items()}
    padded["mask"] = b["mask"] * (~empty).float().unsqueeze(1)
    kept = {k: v[~empty] for k, v in b.items()}
    extra = {"num_seqs": 6} if aggregation == "seq-mean-token-sum-norm" else {}
    loss_p, grad_p, metrics = _run_policy(kind, padded, aggregation=aggregation, **extra)
    loss_k, grad_k, _ = _run_policy(kind, kept, aggregation=aggregation, **extra)
    torch.testing.assert_close(loss_p, loss_k, **TOL)
    torch.testing.assert_close(grad_p[~empty], grad_k, **TOL)
    assert torch.equal(grad_p[empty], torch.zeros_like(grad_p[empty]))
    assert all(torch.isfinite(v).all() for v in metrics.values())


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("kind", ["ppo", "pg"])
@pytest.mark.parametrize("importance", IMPORTANCE)
def test_all_masked_batch_gives_zero_loss(aggregation, kind, importance):
    """An all-masked batch: loss exactly 0, zero gradient, finite metrics (no NaN)."""
    b = _batch(33, N=3, T=4)
    b["mask"] = torch.zeros(3, 4)
    loss, grad, metrics = _run_policy(kind, b, aggregation=aggregation, importance=importance)
    assert loss.item() == 0.0
    assert torch.equal(grad, torch.zeros(3, 4))
    assert all(torch.isfinite(v).all() for v in metrics.values())


@pytest.mark.parametrize("pad_behav", [-1e4, -math.inf])
@pytest.mark.parametrize("importance", IMPORTANCE)
def test_extreme_padding_values_do_not_leak(pad_behav, importance):
    """Padding holding logp_behav = −1e4 / −inf (w overflows) leaves loss and metrics finite."""
    b = _batch(34)
    pad = b["mask"] == 0
    extreme = dict(b)
    extreme["logp_behav"] = torch.where(
        pad, torch.full_like(pad, pad_behav, dtype=torch.float32), b["logp_behav"]
    )
    loss, grad, metrics = _run_policy("ppo", extreme, importance=importance)
    ref_loss, ref_grad, _ = _run_policy("ppo", b, importance=importance)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    torch.testing.assert_close(grad, ref_grad, **TOL)
    assert all(torch.isfinite(v).all() for v in metrics.values()), metrics


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("kind", ["ppo", "pg"])
def test_length_one_responses(seed, aggregation, kind):
    """T = 1 responses match the reference; token-mean equals seq-mean-token-mean there."""
    b = _batch(40 + seed, N=5, T=1, min_len=1)
    loss, grad, _ = _run_policy(kind, b, aggregation=aggregation, dual_clip=3.0)
    ref_loss, ref_grad, _ = _ref_policy(
        **b, kind=kind, aggregation=aggregation, dual_clip=3.0 if kind == "ppo" else None
    )
    _close(loss, ref_loss)
    _close(grad, ref_grad)
    if aggregation == "seq-mean-token-mean":
        other, _, _ = _run_policy(kind, b, aggregation="token-mean", dual_clip=3.0)
        torch.testing.assert_close(loss, other, **TOL)


def test_length_one_response_among_longer_ones():
    """seq-mean-token-mean weights a 1-token response like a long one (hand example)."""
    loss_t = torch.tensor([[2.0, 4.0, 6.0], [10.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    _close(aggregate(loss_t, mask, "seq-mean-token-mean"), (4.0 + 10.0) / 2)
    _close(aggregate(loss_t, mask, "token-mean"), 22.0 / 4)


# ----------------------------------------------------------------------------------------------
# value_loss
# ----------------------------------------------------------------------------------------------


def _ref_value(values, old, targets, mask, clip, num_tokens=None):
    """Loop reference: (loss, dloss/dV, vf_clip_frac)."""
    V, Vo, Vt, m = (x.tolist() for x in (values, old, targets, mask))
    per_token, dper, clipped_flag = [], [], []
    for i in range(len(V)):
        rl, rd, rc = [], [], []
        for t in range(len(V[i])):
            delta = V[i][t] - Vo[i][t]
            delta_c = min(max(delta, -clip), clip)
            plain = (V[i][t] - Vt[i][t]) ** 2
            clipped = (Vo[i][t] + delta_c - Vt[i][t]) ** 2
            if clipped > plain:
                rl.append(0.5 * clipped)
                inside = -clip < delta < clip
                rd.append((Vo[i][t] + delta_c - Vt[i][t]) if inside else 0.0)
                rc.append(1.0)
            else:
                rl.append(0.5 * plain)
                rd.append(V[i][t] - Vt[i][t])
                rc.append(0.0)
        per_token.append(rl)
        dper.append(rd)
        clipped_flag.append(rc)
    loss, scale = _ref_aggregate(per_token, m, m, "token-mean", num_tokens=num_tokens)
    grad = [
        [s * d for s, d in zip(sr, dr, strict=True)] for sr, dr in zip(scale, dper, strict=True)
    ]
    return loss, grad, _masked_mean_ref(clipped_flag, m)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("num_tokens", [None, 40.0])
def test_value_loss_matches_reference(seed, num_tokens):
    """Clipped value loss, its gradient and vf_clip_frac equal the loop reference."""
    gen = torch.Generator().manual_seed(60 + seed)
    N, T = 6, 7
    mask = _ragged_mask(gen, N, T)
    old = torch.randn(N, T, generator=gen)
    values = old + torch.randn(N, T, generator=gen)  # many |V − V_old| > ε_v
    targets = old + torch.randn(N, T, generator=gen)
    values_leaf = _leaf(values)
    loss, metrics = value_loss(values_leaf, old, targets, mask, clip=0.5, num_tokens=num_tokens)
    loss.backward()
    ref_loss, ref_grad, ref_frac = _ref_value(values, old, targets, mask, 0.5, num_tokens)
    _close(loss, ref_loss)
    _close(values_leaf.grad, ref_grad)
    _close(metrics["critic/vf_loss"], ref_loss)
    _close(metrics["critic/vf_clip_frac"], ref_frac)
    assert 0.0 < ref_frac < 1.0  # both branches exercised
    _close(metrics["critic/explained_var"], _ref_explained_variance(values, targets, mask))


def test_value_loss_clipping_hand_example():
    """V_old = 0, ε_v = 0.5. Token 1: V = 2, V_tgt = 0.3 → plain wins, ½·1.7², grad 1.7.
    Token 2: V = 1, V_tgt = 2 → clipped V = 0.5 wins, ½·1.5² = 1.125, grad exactly 0."""
    values = torch.tensor([[2.0, 1.0]], requires_grad=True)
    loss, metrics = value_loss(
        values, torch.zeros(1, 2), torch.tensor([[0.3, 2.0]]), torch.ones(1, 2), clip=0.5
    )
    loss.backward()
    _close(loss, (0.5 * 1.7**2 + 1.125) / 2)
    _close(values.grad, [[1.7 / 2, 0.0]])
    assert values.grad[0, 1].item() == 0.0
    _close(metrics["critic/vf_clip_frac"], 0.5)


def test_value_loss_all_masked_is_zero():
    """An all-masked value batch gives loss 0 with finite metrics."""
    values = torch.randn(2, 3, requires_grad=True)
    loss, metrics = value_loss(values, torch.randn(2, 3), torch.randn(2, 3), torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(values.grad, torch.zeros(2, 3))
    assert all(torch.isfinite(v).all() for v in metrics.values())


# ----------------------------------------------------------------------------------------------
# positive_nll_loss
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("num_tokens", [None, 30.0])
def test_positive_nll_matches_reference(seed, num_tokens):
    """Token-mean of −logp over positive responses only (loss and gradient)."""
    gen = torch.Generator().manual_seed(70 + seed)
    N, T = 6, 5
    mask = _ragged_mask(gen, N, T)
    logp = -3.0 * torch.rand(N, T, generator=gen)
    positive = torch.tensor([True, False, True, True, False, True])
    leaf = _leaf(logp)
    loss, metrics = positive_nll_loss(leaf, mask, positive, num_tokens=num_tokens)
    loss.backward()
    lp, m = logp.tolist(), mask.tolist()
    num, count = 0.0, 0.0
    grad = [[0.0] * T for _ in range(N)]
    for i in range(N):
        for t in range(T):
            if positive[i] and m[i][t]:
                num += -lp[i][t]
                count += 1.0
    denom = max(count if num_tokens is None else num_tokens, 1.0)
    for i in range(N):
        for t in range(T):
            if positive[i] and m[i][t]:
                grad[i][t] = -1.0 / denom
    _close(loss, num / denom)
    _close(leaf.grad, grad)
    _close(metrics["actor/nll_loss"], num / denom)


def test_positive_nll_none_positive_is_zero():
    """No positive response: loss exactly 0 with zero gradient."""
    logp = (-torch.rand(3, 4)).requires_grad_(True)
    loss, _ = positive_nll_loss(logp, torch.ones(3, 4), torch.zeros(3, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logp.grad, torch.zeros(3, 4))


def test_positive_nll_hand_example():
    """Positive rows [−1, −2] and [−4]; the negative row is ignored → (1 + 2 + 4) / 3."""
    logp = torch.tensor([[-1.0, -2.0], [-9.0, -9.0], [-4.0, -7.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    loss, _ = positive_nll_loss(logp, mask, torch.tensor([True, False, True]))
    _close(loss, 7.0 / 3)


# ----------------------------------------------------------------------------------------------
# explained_variance
# ----------------------------------------------------------------------------------------------


def _ref_explained_variance(values, targets, mask) -> float:
    V, Vt, m = values.tolist(), targets.tolist(), mask.tolist()
    t_list, r_list = [], []
    for i in range(len(V)):
        for t in range(len(V[i])):
            if m[i][t]:
                t_list.append(Vt[i][t])
                r_list.append(Vt[i][t] - V[i][t])

    def var(xs):
        if not xs:
            return 0.0
        mu = sum(xs) / len(xs)
        return sum((x - mu) ** 2 for x in xs) / len(xs)

    var_t = var(t_list)
    if var_t <= 1e-12:
        return 0.0
    return 1.0 - var(r_list) / var_t


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_explained_variance_matches_reference(seed):
    """1 − Var(t − v)/Var(t) over masked tokens equals the loop reference."""
    gen = torch.Generator().manual_seed(80 + seed)
    mask = _ragged_mask(gen, 5, 6)
    targets = torch.randn(5, 6, generator=gen)
    values = targets + 0.5 * torch.randn(5, 6, generator=gen)
    values = torch.where(mask == 0, 100.0 * torch.randn(5, 6, generator=gen), values)
    _close(
        explained_variance(values, targets, mask), _ref_explained_variance(values, targets, mask)
    )


def test_explained_variance_special_cases():
    """Perfect critic → 1, constant-mean critic → 0, worse than constant → negative."""
    gen = torch.Generator().manual_seed(90)
    mask = _ragged_mask(gen, 4, 5)
    targets = torch.randn(4, 5, generator=gen)
    _close(explained_variance(targets.clone(), targets, mask), 1.0)
    mean = (targets * mask).sum() / mask.sum()
    _close(explained_variance(torch.full_like(targets, float(mean)), targets, mask), 0.0)
    assert explained_variance(-targets, targets, mask).item() < 0.0


def test_explained_variance_zero_variance_targets_is_zero():
    """Targets constant on masked tokens (garbage elsewhere): defined as 0, never NaN."""
    targets = torch.tensor([[2.0, 2.0, 50.0], [2.0, -7.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    got = explained_variance(torch.tensor([[1.0, 3.0, 0.0], [2.0, 0.0, 0.0]]), targets, mask)
    assert got.item() == 0.0
    assert explained_variance(targets, targets, torch.zeros(2, 3)).item() == 0.0
