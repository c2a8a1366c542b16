"""GSPO and GSPO-token under the correction's rejections (docs/algorithms.md, "Policy losses
beyond the clipped ratio": s_i sums over loss tokens with m = 1, and a rejected token has
m ← 0). Whatever rejects a token — a token band, `importance: mask`, IcePop — or a whole
response — a sequence or geometric band, the veto — the rejected token neither moves s_i nor
receives a gradient, while it stays in the aggregation's denominator. The reference below is
written from the formulas over the kept tokens the test chooses, not from the code's mask."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import TypeAdapter

from streamrl.algorithms.correction_config import CorrectionConfig, correction_of_importance
from streamrl.algorithms.policy_losses import GSPOLoss, GSPOTokenLoss, policy_loss

T = 5
REJECTED = (0, 2)  # response 0, token 2
CLIP_LOW, CLIP_HIGH = 0.5, 0.5  # wide: every s_i inside the band, every token has a gradient


def _correction(block: dict) -> CorrectionConfig:
    return TypeAdapter(CorrectionConfig).validate_python(block)


# (correction, δ = logp_prox − logp_behav at the rejected token, whole response rejected)
CASES = {
    "token band": ({"method": "rollout", "rs_level": "token", "rs_high": 2.0}, 3.0, False),
    "importance mask": (correction_of_importance({"mode": "mask", "cap": 2.0}), 3.0, False),
    "icepop": ({"method": "icepop", "low": 0.5, "high": 5.0}, 3.0, False),
    "sequence band": ({"method": "rollout", "rs_level": "sequence", "rs_high": 2.0}, 3.0, True),
    "geometric band": ({"method": "rollout", "rs_level": "geometric", "rs_high": 1.5}, 3.0, True),
    "veto": ({"method": "rollout", "veto": 1e-4}, -12.0, True),
}


def _batch(delta: float):
    """Three responses: 0 holds the rejected token, whose learner log-prob moved far (+1.5)
    from the proximal one; 1 has a shorter loss mask; 2 none. The behaviour log-probs equal
    the proximal ones elsewhere (ρ = 1: kept, weight 1)."""
    g = torch.Generator().manual_seed(7)
    logp_prox = -0.2 - 2.0 * torch.rand(3, T, generator=g)
    logp = (logp_prox + 0.1 * torch.randn(3, T, generator=g)).detach()
    logp[REJECTED] = logp_prox[REJECTED] + 1.5
    logp_behav = logp_prox.clone()
    logp_behav[REJECTED] = logp_prox[REJECTED] - delta
    mask = torch.ones(3, T)
    mask[1, 3:] = 0
    mask[2] = 0
    advantages = torch.tensor([[1.3], [-0.8], [0.4]]).expand(3, T).clone()
    return logp.requires_grad_(), logp_prox, logp_behav, advantages, mask


def _reference(logp, logp_prox, advantages, mask, kept, token_level: bool):
    """seq-mean-token-mean of −min(s·A, clip(s)·A) with s_i over the kept tokens; every loss
    token of a response counts in its denominator, kept or not. `token_level`: GSPO-token's
    s_{i,t} = sg[s_i]·exp(logp_t − sg[logp_t]). Returns (loss, [s_i or None])."""
    total, scored, ratios = 0.0, 0, []
    for i in range(mask.shape[0]):
        loss_tokens = [t for t in range(T) if mask[i, t] > 0]
        kept_tokens = [t for t in loss_tokens if kept[i][t]]
        scored += bool(loss_tokens)
        if not kept_tokens:
            ratios.append(None)
            continue
        s = torch.exp(sum(logp[i, t] - logp_prox[i, t] for t in kept_tokens) / len(kept_tokens))
        ratios.append(float(s.detach()))
        response = 0.0
        for t in kept_tokens:
            ratio = s.detach() * torch.exp(logp[i, t] - logp[i, t].detach()) if token_level else s
            a = float(advantages[i, t])
            clipped = ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH)
            response = response - torch.minimum(ratio * a, clipped * a)
        total = total + response / len(loss_tokens)
    return total / scored, ratios


@pytest.mark.parametrize("loss", [GSPOLoss, GSPOTokenLoss], ids=["gspo", "gspo_token"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_rejected_token_neither_moves_the_sequence_ratio_nor_gets_a_gradient(
    loss: type[GSPOLoss], case: str
) -> None:
    block, delta, whole_response = CASES[case]
    logp, logp_prox, logp_behav, advantages, mask = _batch(delta)
    kept = [[bool(mask[i, t]) for t in range(T)] for i in range(3)]
    kept[0] = [False] * T if whole_response else [t != REJECTED[1] for t in range(T)]

    value, metrics = policy_loss(
        loss(clip_low=CLIP_LOW, clip_high=CLIP_HIGH),
        logp,
        logp_prox,
        logp_behav,
        advantages,
        mask,
        correction=_correction(block),
        aggregation="seq-mean-token-mean",
    )
    value.backward()
    grad = logp.grad.clone()

    reference = logp.detach().clone().requires_grad_()
    ref_value, ratios = _reference(
        reference, logp_prox, advantages, mask, kept, token_level=loss is GSPOTokenLoss
    )
    ref_value.backward()

    torch.testing.assert_close(value.detach(), ref_value.detach())
    torch.testing.assert_close(grad, reference.grad)
    assert grad[REJECTED] == 0
    if whole_response:
        assert torch.all(grad[0] == 0)
    else:
        assert torch.all(grad[0][torch.tensor(kept[0])] != 0)  # the kept tokens still learn
    # actor/seq_ratio_mean: the mean of s_i over the kept tokens, a rejected response's absent
    kept_counts = [sum(row) for row in kept]
    expected = sum(n * s for n, s in zip(kept_counts, ratios, strict=True) if s is not None)
    seq_ratio_mean = metrics["actor/seq_ratio_mean"]
    assert float(seq_ratio_mean.count) == sum(kept_counts)
    assert float(seq_ratio_mean.total) == pytest.approx(expected, rel=1e-5)


def test_the_sequence_ratio_of_a_response_with_a_rejected_token_is_the_kept_tokens_mean() -> None:
    """The token-band case spelled out: s_0 = exp(mean of the four kept log-ratios), whatever
    the rejected token's own log-ratio (1.5 here, e^1.5 ≈ 4.5 as a token ratio)."""
    logp, logp_prox, logp_behav, advantages, mask = _batch(3.0)
    single = slice(0, 1)
    value, metrics = policy_loss(
        GSPOLoss(clip_low=CLIP_LOW, clip_high=CLIP_HIGH),
        logp[single],
        logp_prox[single],
        logp_behav[single],
        advantages[single],
        mask[single],
        correction=_correction(CASES["token band"][0]),
        aggregation="seq-mean-token-mean",
    )
    kept = [t for t in range(T) if t != REJECTED[1]]
    log_ratios = (logp.detach() - logp_prox)[0, kept]
    s_0 = math.exp(float(log_ratios.mean()))
    seq_ratio_mean = metrics["actor/seq_ratio_mean"]
    assert float(seq_ratio_mean.total / seq_ratio_mean.count) == pytest.approx(s_0, rel=1e-6)
    # four kept tokens of five loss tokens carry −s_0·A_0 each; the rejected one counts as 0
    assert float(value.detach()) == pytest.approx(-s_0 * 1.3 * len(kept) / T, rel=1e-6)
