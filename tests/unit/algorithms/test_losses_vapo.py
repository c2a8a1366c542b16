"""VAPO's extra loss terms: the critic's clipped `value_loss` (with `explained_variance`,
its health metric) and `positive_nll_loss`, the language-model loss on positive responses.
Each against a loop reference written here, plus hand examples.
"""

from __future__ import annotations

import pytest
import torch

from streamrl.algorithms.losses import explained_variance, positive_nll_loss, value_loss
from tests.unit.algorithms.loss_reference import (
    as_leaf,
    close,
    metrics_finite,
    ragged_mask,
    ref_aggregate,
    ref_masked_mean,
)


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
    loss, scale = ref_aggregate(per_token, m, m, "token-mean", num_tokens=num_tokens)
    grad = [
        [s * d for s, d in zip(sr, dr, strict=True)] for sr, dr in zip(scale, dper, strict=True)
    ]
    return loss, grad, ref_masked_mean(clipped_flag, m)


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
@pytest.mark.parametrize("num_tokens", [None, 40.0])
def test_value_loss_matches_reference(seed, num_tokens):
    """Clipped value loss, its gradient and vf_clip_frac equal the loop reference."""
    gen = torch.Generator().manual_seed(60 + seed)
    N, T = 6, 7
    mask = ragged_mask(gen, N, T)
    old = torch.randn(N, T, generator=gen)
    values = old + torch.randn(N, T, generator=gen)  # many |V − V_old| > ε_v
    targets = old + torch.randn(N, T, generator=gen)
    values_leaf = as_leaf(values)
    loss, metrics = value_loss(values_leaf, old, targets, mask, clip=0.5, num_tokens=num_tokens)
    loss.backward()
    ref_loss, ref_grad, ref_frac = _ref_value(values, old, targets, mask, 0.5, num_tokens)
    close(loss, ref_loss)
    close(values_leaf.grad, ref_grad)
    close(metrics["critic/vf_loss"], ref_loss)
    close(metrics["critic/vf_clip_frac"], ref_frac)
    assert 0.0 < ref_frac < 1.0  # both branches exercised
    close(metrics["critic/explained_var"], _ref_explained_variance(values, targets, mask))


def test_value_loss_clipping_hand_example():
    """V_old = 0, ε_v = 0.5. Token 1: V = 2, V_tgt = 0.3 → plain wins, ½·1.7², grad 1.7.
    Token 2: V = 1, V_tgt = 2 → clipped V = 0.5 wins, ½·1.5² = 1.125, grad exactly 0."""
    values = torch.tensor([[2.0, 1.0]], requires_grad=True)
    loss, metrics = value_loss(
        values, torch.zeros(1, 2), torch.tensor([[0.3, 2.0]]), torch.ones(1, 2), clip=0.5
    )
    loss.backward()
    close(loss, (0.5 * 1.7**2 + 1.125) / 2)
    close(values.grad, [[1.7 / 2, 0.0]])
    assert values.grad[0, 1].item() == 0.0
    close(metrics["critic/vf_clip_frac"], 0.5)


def test_value_loss_all_masked_is_zero():
    """An all-masked value batch gives loss 0 with finite metrics."""
    values = torch.randn(2, 3, requires_grad=True)
    loss, metrics = value_loss(values, torch.randn(2, 3), torch.randn(2, 3), torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(values.grad, torch.zeros(2, 3))
    assert metrics_finite(metrics)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("num_tokens", [None, 30.0])
def test_positive_nll_matches_reference(seed, num_tokens):
    """Token-mean of −logp over positive responses only (loss and gradient)."""
    gen = torch.Generator().manual_seed(70 + seed)
    N, T = 6, 5
    mask = ragged_mask(gen, N, T)
    logp = -3.0 * torch.rand(N, T, generator=gen)
    positive = torch.tensor([True, False, True, True, False, True])
    leaf = as_leaf(logp)
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
    close(loss, num / denom)
    close(leaf.grad, grad)
    close(metrics["actor/nll_loss"], num / denom)


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
    close(loss, 7.0 / 3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_explained_variance_matches_reference(seed):
    """1 − Var(t − v)/Var(t) over masked tokens equals the loop reference."""
    gen = torch.Generator().manual_seed(80 + seed)
    mask = ragged_mask(gen, 5, 6)
    targets = torch.randn(5, 6, generator=gen)
    values = targets + 0.5 * torch.randn(5, 6, generator=gen)
    values = torch.where(mask == 0, 100.0 * torch.randn(5, 6, generator=gen), values)
    close(explained_variance(values, targets, mask), _ref_explained_variance(values, targets, mask))


def test_explained_variance_special_cases():
    """Perfect critic → 1, constant-mean critic → 0, worse than constant → negative."""
    gen = torch.Generator().manual_seed(90)
    mask = ragged_mask(gen, 4, 5)
    targets = torch.randn(4, 5, generator=gen)
    close(explained_variance(targets.clone(), targets, mask), 1.0)
    mean = (targets * mask).sum() / mask.sum()
    close(explained_variance(torch.full_like(targets, float(mean)), targets, mask), 0.0)
    assert explained_variance(-targets, targets, mask).item() < 0.0


def test_explained_variance_zero_variance_targets_is_zero():
    """Targets constant on masked tokens (garbage elsewhere): defined as 0, never NaN."""
    targets = torch.tensor([[2.0, 2.0, 50.0], [2.0, -7.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    got = explained_variance(torch.tensor([[1.0, 3.0, 0.0], [2.0, 0.0, 0.0]]), targets, mask)
    assert got.item() == 0.0
    assert explained_variance(targets, targets, torch.zeros(2, 3)).item() == 0.0
