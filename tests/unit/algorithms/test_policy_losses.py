"""GSPO, GSPO-token, CISPO and SAPO (`streamrl.algorithms.policy_losses`) against references
written here token by token from docs/algorithms.md ("Policy losses beyond the clipped
ratio"): values and gradients, a response without loss tokens, ratios at the band's edges,
GSPO-token = GSPO for per-response advantages, SAPO's weight 1 on-policy, CISPO's gradient on
tokens outside its band."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import TypeAdapter, ValidationError

from streamrl.algorithms.correction_config import RolloutCorrection
from streamrl.algorithms.policy_losses import (
    CISPOLoss,
    GSPOLoss,
    GSPOTokenLoss,
    PolicyLoss,
    PPOClipLoss,
    SAPOLoss,
    check_loss_fields,
    policy_loss,
    ppo_policy_loss,
)
from streamrl.algorithms.reductions import Mean

NO_CORRECTION = RolloutCorrection(is_level="none")
N, T = 4, 6


def _batch(seed: int = 0, spread: float = 0.3):
    """Log-probs with grad, proximal ones `spread` away, per-response advantages, a mask
    whose third response has no loss token."""
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(N, T, generator=g) * 2).requires_grad_()
    logp_prox = logp.detach() + spread * torch.randn(N, T, generator=g)
    advantages = torch.tensor([1.5, -0.7, 2.0, -1.2]).unsqueeze(-1).expand(N, T).clone()
    mask = torch.ones(N, T)
    mask[0, 4:] = 0
    mask[1, :2] = 0
    mask[2] = 0  # no loss token: no loss, no gradient
    return logp, logp_prox, advantages, mask


def _rows(mask: torch.Tensor) -> list[list[int]]:
    return [[t for t in range(T) if mask[i, t] > 0] for i in range(N)]


def _seq_mean_token_mean(per_token: dict[tuple[int, int], torch.Tensor], mask) -> torch.Tensor:
    rows = [r for r in _rows(mask) if r]
    total = sum(
        sum(per_token[i, t] for t in row) / len(row) for i, row in enumerate(_rows(mask)) if row
    )
    return total / len(rows)


def _token_mean(per_token: dict[tuple[int, int], torch.Tensor], mask) -> torch.Tensor:
    keys = [(i, t) for i, row in enumerate(_rows(mask)) for t in row]
    return sum(per_token[k] for k in keys) / len(keys)


def _gspo_reference(logp, logp_prox, advantages, mask, low, high) -> torch.Tensor:
    per_token = {}
    for i, row in enumerate(_rows(mask)):
        if not row:
            continue
        s = torch.exp(sum(logp[i, t] - logp_prox[i, t] for t in row) / len(row))
        a = advantages[i, row[0]]
        clipped = min(max(s, torch.tensor(1 - low)), torch.tensor(1 + high))
        loss_i = -torch.min(s * a, clipped * a) if (clipped * a) != (s * a) else -(s * a)
        for t in row:
            per_token[i, t] = loss_i
    return _seq_mean_token_mean(per_token, mask)


def _cispo_reference(logp, logp_prox, advantages, mask, low, high) -> torch.Tensor:
    per_token = {}
    for i, row in enumerate(_rows(mask)):
        for t in row:
            r = math.exp(float(logp[i, t].detach() - logp_prox[i, t]))
            weight = min(max(r, 1 - low), 1 + high)
            per_token[i, t] = -weight * float(advantages[i, t]) * logp[i, t]
    return _token_mean(per_token, mask)


def _sapo_reference(logp, logp_prox, advantages, mask, tau_pos, tau_neg) -> torch.Tensor:
    per_token = {}
    for i, row in enumerate(_rows(mask)):
        for t in row:
            a = float(advantages[i, t])
            tau = tau_pos if a > 0 else tau_neg
            r = torch.exp(logp[i, t] - logp_prox[i, t])
            per_token[i, t] = -(4 / tau) * torch.sigmoid(tau * (r - 1)) * a
    return _seq_mean_token_mean(per_token, mask)


def _metric(metric: Mean) -> float:
    """A loss's metric, a mean over the kept loss tokens, as one number."""
    return float(metric.total / metric.count.clamp(min=1.0))


def _value_and_grad(loss_fn, logp) -> tuple[torch.Tensor, torch.Tensor]:
    logp.grad = None
    value = loss_fn()
    value.backward()
    return value.detach(), logp.grad.clone()


def _ours(loss, logp, logp_prox, advantages, mask, aggregation, **kwargs):
    return policy_loss(
        loss, logp, logp_prox, None, advantages, mask,
        correction=NO_CORRECTION, aggregation=aggregation, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize(("low", "high"), [(3e-4, 4e-4), (0.05, 0.1), (0.5, 0.5)])
def test_gspo_matches_the_reference_in_value_and_gradient(low: float, high: float) -> None:
    logp, logp_prox, advantages, mask = _batch(spread=0.05)
    loss = GSPOLoss(clip_low=low, clip_high=high)
    value, grad = _value_and_grad(
        lambda: _ours(loss, logp, logp_prox, advantages, mask, "seq-mean-token-mean")[0], logp
    )
    ref_value, ref_grad = _value_and_grad(
        lambda: _gspo_reference(logp, logp_prox, advantages, mask, low, high), logp
    )
    torch.testing.assert_close(value, ref_value)
    torch.testing.assert_close(grad, ref_grad)
    assert torch.all(grad[2] == 0)  # the response without loss tokens
    assert torch.all(grad[mask == 0] == 0)


def test_gspo_token_equals_gspo_for_per_response_advantages() -> None:
    """Value and gradient, with the default token-level correction weights too."""
    logp, logp_prox, advantages, mask = _batch(spread=0.02)
    behav = logp_prox + 0.1
    results = []
    for loss in (
        GSPOLoss(clip_low=0.01, clip_high=0.02),
        GSPOTokenLoss(clip_low=0.01, clip_high=0.02),
    ):
        logp.grad = None
        value, metrics = policy_loss(
            loss, logp, logp_prox, behav, advantages, mask, aggregation="seq-mean-token-mean"
        )
        value.backward()
        results.append((value.detach(), logp.grad.clone(), _metric(metrics["actor/clip_frac"])))
    (v1, g1, c1), (v2, g2, c2) = results
    torch.testing.assert_close(v1, v2)
    torch.testing.assert_close(g1, g2)
    assert c1 == c2
    assert 0 < c1 < 1  # some responses outside the band, not all


def test_gspo_ratio_at_the_band_edges_keeps_its_gradient_and_is_not_counted_as_clipped() -> None:
    """A response whose s_i lies exactly on 1 − ε_low or 1 + ε_high is inside the band."""
    logp = torch.zeros(2, 3).requires_grad_()
    mask = torch.ones(2, 3)
    low, high = 0.25, 0.5
    logp_prox = torch.stack(
        [torch.full((3,), -math.log(1 - low)), torch.full((3,), -math.log(1 + high))]
    )
    advantages = torch.tensor([[-1.0] * 3, [1.0] * 3])
    value, metrics = _ours(
        GSPOLoss(clip_low=low, clip_high=high),
        logp,
        logp_prox,
        advantages,
        mask,
        "seq-mean-token-mean",
    )
    value.backward()
    assert _metric(metrics["actor/clip_frac"]) == 0
    assert torch.all(logp.grad != 0)


def test_a_batch_without_loss_tokens_has_zero_loss_and_gradient() -> None:
    logp, logp_prox, advantages, _ = _batch()
    mask = torch.zeros(N, T)
    for loss in (GSPOLoss(), GSPOTokenLoss(), CISPOLoss(), SAPOLoss(), PPOClipLoss()):
        logp.grad = None
        value, _ = _ours(loss, logp, logp_prox, advantages, mask, "seq-mean-token-mean")
        value.backward()
        assert value == 0, loss.kind
        assert torch.all(logp.grad == 0), loss.kind


def test_cispo_matches_the_reference_and_keeps_a_gradient_outside_its_band() -> None:
    logp, logp_prox, advantages, mask = _batch(spread=0.6)
    loss = CISPOLoss(clip_low=0.2, clip_high=0.28)
    value, grad = _value_and_grad(
        lambda: _ours(loss, logp, logp_prox, advantages, mask, "token-mean")[0], logp
    )
    ref_value, ref_grad = _value_and_grad(
        lambda: _cispo_reference(logp, logp_prox, advantages, mask, 0.2, 0.28), logp
    )
    torch.testing.assert_close(value, ref_value)
    torch.testing.assert_close(grad, ref_grad)
    ratio = torch.exp(logp.detach() - logp_prox)
    outside = (mask > 0) & ((ratio < 0.8) | (ratio > 1.28))
    assert outside.any()
    assert torch.all(grad[outside] != 0)  # PPO's clip would give these tokens no gradient
    _, metrics = _ours(loss, logp, logp_prox, advantages, mask, "token-mean")
    assert _metric(metrics["actor/clip_frac"]) == pytest.approx(float(outside.sum() / mask.sum()))


def test_sapo_matches_the_reference_off_policy() -> None:
    logp, logp_prox, advantages, mask = _batch(spread=0.4)
    loss = SAPOLoss(tau_pos=1.0, tau_neg=1.05)
    value, grad = _value_and_grad(
        lambda: _ours(loss, logp, logp_prox, advantages, mask, "seq-mean-token-mean")[0], logp
    )
    ref_value, ref_grad = _value_and_grad(
        lambda: _sapo_reference(logp, logp_prox, advantages, mask, 1.0, 1.05), logp
    )
    torch.testing.assert_close(value, ref_value)
    torch.testing.assert_close(grad, ref_grad)


def test_on_policy_sapo_and_cispo_are_the_plain_policy_gradient() -> None:
    """r = 1: SAPO's gate weight is 1 and CISPO's weight 1, so both gradients equal
    −A·∇logp_θ aggregated alike (the plain policy gradient)."""
    logp, _, advantages, mask = _batch()
    logp_prox = logp.detach()
    for loss, aggregation in ((SAPOLoss(), "seq-mean-token-mean"), (CISPOLoss(), "token-mean")):

        def ours(loss=loss, aggregation=aggregation):
            return _ours(loss, logp, logp_prox, advantages, mask, aggregation)[0]

        def plain(aggregation=aggregation):
            return _ours(PPOClipLoss(), logp, logp_prox, advantages, mask, aggregation)[0]

        torch.testing.assert_close(_value_and_grad(ours, logp)[1], _value_and_grad(plain, logp)[1])
    _, metrics = _ours(SAPOLoss(), logp, logp_prox, advantages, mask, "seq-mean-token-mean")
    assert _metric(metrics["actor/gate_weight_mean"]) == pytest.approx(1.0)


def test_ppo_clip_through_policy_loss_is_ppo_policy_loss() -> None:
    logp, logp_prox, advantages, mask = _batch(spread=0.4)
    behav = logp_prox - 0.2
    ours = PPOClipLoss(clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    value, grad = _value_and_grad(
        lambda: policy_loss(ours, logp, logp_prox, behav, advantages, mask)[0], logp
    )
    kwargs = {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0}
    ref_value, ref_grad = _value_and_grad(
        lambda: ppo_policy_loss(logp, logp_prox, behav, advantages, mask, **kwargs)[0], logp
    )
    torch.testing.assert_close(value, ref_value)
    torch.testing.assert_close(grad, ref_grad)


def test_a_field_of_another_loss_is_refused_naming_where_it_belongs() -> None:
    with pytest.raises(
        ValueError,
        match=r"policy_loss.tau_pos is a parameter of policy_loss kind sapo, not of gspo",
    ):
        check_loss_fields({"kind": "gspo", "tau_pos": 2.0})
    with pytest.raises(ValueError, match=r"dual_clip is a parameter of policy_loss kind ppo_clip"):
        check_loss_fields({"kind": "cispo", "dual_clip": 3.0})
    adapter = TypeAdapter(PolicyLoss)
    assert adapter.validate_python({"kind": "cispo"}) == CISPOLoss(clip_low=1.0, clip_high=0.28)
    with pytest.raises(ValidationError):
        adapter.validate_python({"kind": "grpo_clip"})
