"""Loop-based references for the tests of `streamrl.algorithms.losses` (docs/algorithms.md).

Every reference here works on Python floats, one sample and one token at a time, straight from
the formulas (per-token PPO / GPG loss, importance correction, the three aggregations with the
documented denominator convention for importance="mask"). Gradients w.r.t. logp are compared
with the hand-derived derivative: −w·A·r where the unclipped branch is taken, 0 where the
clipped or dual-clip branch is, −w·A for GPG, each scaled by the aggregation's denominator.
The random batches hold finite garbage in their padding, which must never leak into a loss.
"""

from __future__ import annotations

import math

import torch
from pydantic import TypeAdapter
from torch import Tensor

from streamrl.algorithms.correction_config import CorrectionConfig, correction_of_importance
from streamrl.algorithms.policy_losses import pg_loss, ppo_policy_loss
from streamrl.algorithms.reductions import Mean

AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
IMPORTANCE = ["tis", "mask", "none"]
TOL = {"atol": 1e-5, "rtol": 1e-5}


def close(actual: Tensor | Mean, expected) -> None:
    """assert_close against a Python float / nested list computed by a reference (a `Mean`
    metric: its value over the step)."""
    if isinstance(actual, Mean):
        actual = actual.total / actual.count.clamp(min=1.0)
    expected_t = torch.tensor(expected, dtype=torch.float64).to(actual.dtype)
    torch.testing.assert_close(actual.detach(), expected_t, **TOL)


def metrics_finite(metrics: dict) -> bool:
    """Every metric finite: a tensor, or both parts of a `Mean` (counts may be 0)."""
    parts = [
        p for v in metrics.values() for p in ((v.total, v.count) if hasattr(v, "count") else (v,))
    ]
    return all(torch.isfinite(part).all() for part in parts)


def ragged_mask(gen: torch.Generator, N: int, T: int, min_len: int = 0) -> Tensor:
    """Right-padded 0/1 mask with random lengths; row 0 is full, row 1 empty when allowed."""
    lengths = torch.randint(min_len, T + 1, (N,), generator=gen)
    lengths[0] = T
    if min_len == 0 and N > 2:
        lengths[1] = 0
    return (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()


def random_batch(seed: int, N: int = 6, T: int = 7, min_len: int = 0) -> dict[str, Tensor]:
    """Random policy-loss inputs; padded positions hold finite garbage that must not leak."""
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(gen, N, T, min_len)
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


def as_leaf(x: Tensor) -> Tensor:
    return x.detach().clone().requires_grad_(True)


def ref_weights(prox: float, behav: float | None, m: float, importance: str, cap: float):
    """(w, numerator mask, raw w) for one token per the importance-correction rule."""
    raw = 1.0 if behav is None else math.exp(prox - behav)
    if importance == "tis":
        return min(raw, cap), m, raw
    if importance == "mask":
        return raw, (m if raw <= cap else 0.0), raw
    return 1.0, m, raw


def ref_aggregate(values, keep, count_mask, mode, *, num_tokens=None, num_seqs=None, max_len=None):
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


def ref_masked_mean(values, mask) -> float:
    num = 0.0
    den = 0.0
    for row_v, row_m in zip(values, mask, strict=True):
        for v, m in zip(row_v, row_m, strict=True):
            if m:
                num += v
                den += 1.0
    return num / max(den, 1.0)


def ref_policy(
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
    applied_w = [[0.0] * T for _ in range(N)]  # the weight that multiplies the token's loss
    over = [[0.0] * T for _ in range(N)]
    clip_taken = [[0.0] * T for _ in range(N)]
    dual_taken = [[0.0] * T for _ in range(N)]
    log_ratio_neg = [[0.0] * T for _ in range(N)]
    for i in range(N):
        for t in range(T):
            behav = None if bh is None else bh[i][t]
            w, keep[i][t], raw_w[i][t] = ref_weights(px[i][t], behav, m[i][t], importance, cap)
            applied_w[i][t] = w
            truncates = importance != "none"  # none has no cap: no weight is truncated
            over[i][t] = 1.0 if truncates and raw_w[i][t] > cap else 0.0
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
    loss, scale = ref_aggregate(
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
        "actor/ppo_kl": ref_masked_mean(log_ratio_neg, m),
        "actor/is_weight_mean": ref_masked_mean(applied_w, keep),
        "actor/is_clip_frac": ref_masked_mean(over, m),
    }
    if kind == "ppo":  # the loss's own metrics count the kept tokens, not rejected ones
        metrics["actor/clip_frac"] = ref_masked_mean(clip_taken, keep)
        metrics["actor/dual_clip_frac"] = ref_masked_mean(dual_taken, keep)
    return loss, grad, metrics


def correction(mode: str = "tis", cap: float = 2.0):
    """The off-policy correction the older `importance: {mode, cap}` spelled (the alias every
    existing config still reads: `correction_of_importance`)."""
    block = correction_of_importance({"mode": mode, "cap": cap})
    return TypeAdapter(CorrectionConfig).validate_python(block)


def importance_weights(logp_prox, logp_behav, mask, mode: str, cap: float):
    """(w, narrowed mask, metrics) of the importance mode `mode`, as the losses apply it."""
    got = correction(mode, cap).apply(logp_prox, logp_behav, mask)
    return got.weights, got.mask, got.metrics


def run_policy(kind: str, b: dict[str, Tensor], **kwargs):
    """Call the implementation with a fresh leaf logp; return (loss, logp.grad, metrics).
    `importance=` and `importance_cap=` name the correction as the older config did."""
    logp = as_leaf(b["logp"])
    if "importance" in kwargs or "importance_cap" in kwargs:
        kwargs["correction"] = correction(
            kwargs.pop("importance", "tis"), kwargs.pop("importance_cap", 2.0)
        )
    fn = ppo_policy_loss if kind == "ppo" else pg_loss
    if kind == "pg":
        for key in ("clip_low", "clip_high", "dual_clip"):
            kwargs.pop(key, None)
    behav = kwargs.pop("logp_behav", b["logp_behav"])
    loss, metrics = fn(logp, b["logp_prox"], behav, b["advantages"], b["mask"], **kwargs)
    loss.backward()
    return loss, logp.grad, metrics


def ref_kwargs(kwargs: dict) -> dict:
    out = dict(kwargs)
    if "importance_cap" in out:
        out["cap"] = out.pop("importance_cap")
    return out


def global_counts(mask: Tensor) -> dict[str, float]:
    return {
        "num_tokens": float(mask.sum()),
        "num_seqs_nonempty": float((mask.sum(-1) > 0).sum()),
        "num_seqs_all": float(mask.shape[0]),
    }
