"""The preference losses (ALGORITHMS.md "Preference optimization") against the formulas written
out by hand, and the direction each one pushes the policy."""

from __future__ import annotations

import math

import pytest
import torch

from streamrl.algorithms.preference import DEFAULT_BETA, pair_loss, summed_logprobs

# Two pairs: summed log-probs under the policy and the reference, and response lengths.
CHOSEN, REJECTED = torch.tensor([-10.0, -4.0]), torch.tensor([-12.0, -3.0])
REF_CHOSEN, REF_REJECTED = torch.tensor([-11.0, -4.5]), torch.tensor([-11.5, -2.0])
N_CHOSEN, N_REJECTED = torch.tensor([5, 2]), torch.tensor([6, 4])


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _loss(kind, **kw):
    return pair_loss(
        kind, CHOSEN, REJECTED, N_CHOSEN, N_REJECTED,
        ref_chosen=REF_CHOSEN, ref_rejected=REF_REJECTED, **kw,
    )  # fmt: skip


def test_dpo_with_and_without_label_smoothing():
    beta = 0.1
    out = _loss("dpo", beta=beta)
    for k in range(2):
        r_w = beta * (CHOSEN[k] - REF_CHOSEN[k]).item()
        r_l = beta * (REJECTED[k] - REF_REJECTED[k]).item()
        assert out.reward_chosen[k].item() == pytest.approx(r_w)
        assert out.reward_rejected[k].item() == pytest.approx(r_l)
        assert out.loss[k].item() == pytest.approx(-math.log(_sigmoid(r_w - r_l)))
        smoothed = _loss("dpo", beta=beta, label_smoothing=0.2).loss[k].item()
        h = r_w - r_l
        assert smoothed == pytest.approx(
            -0.8 * math.log(_sigmoid(h)) - 0.2 * math.log(_sigmoid(-h))
        )
    assert out.margin.tolist() == pytest.approx((out.reward_chosen - out.reward_rejected).tolist())


def test_ipo_is_the_squared_distance_of_the_length_averaged_log_ratios():
    beta = 0.1
    out = _loss("ipo", beta=beta)
    for k in range(2):
        u = (CHOSEN[k] - REF_CHOSEN[k]).item() / N_CHOSEN[k].item() - (
            REJECTED[k] - REF_REJECTED[k]
        ).item() / N_REJECTED[k].item()
        assert out.loss[k].item() == pytest.approx((u - 1 / (2 * beta)) ** 2)


def test_simpo_needs_no_reference_and_keeps_a_margin():
    out = pair_loss("simpo", CHOSEN, REJECTED, N_CHOSEN, N_REJECTED, beta=2.0, gamma=0.5)
    for k in range(2):
        r_w = 2.0 * CHOSEN[k].item() / N_CHOSEN[k].item()
        r_l = 2.0 * REJECTED[k].item() / N_REJECTED[k].item()
        assert out.loss[k].item() == pytest.approx(-math.log(_sigmoid(r_w - r_l - 0.5)))
    with pytest.raises(ValueError, match="reference"):
        pair_loss("dpo", CHOSEN, REJECTED, N_CHOSEN, N_REJECTED, beta=0.1)
    assert DEFAULT_BETA == {"dpo": 0.1, "ipo": 0.1, "simpo": 2.0}


def test_the_nll_term_adds_the_chosen_token_mean_nll():
    plain, with_nll = _loss("dpo", beta=0.1), _loss("dpo", beta=0.1, nll_weight=0.5)
    expected = plain.loss + 0.5 * (-CHOSEN / N_CHOSEN)
    assert with_nll.loss.tolist() == pytest.approx(expected.tolist())


@pytest.mark.parametrize("kind", ["dpo", "ipo", "simpo"])
def test_every_loss_raises_the_chosen_and_lowers_the_rejected(kind):
    chosen, rejected = CHOSEN.clone().requires_grad_(), REJECTED.clone().requires_grad_()
    pair_loss(
        kind, chosen, rejected, N_CHOSEN, N_REJECTED, ref_chosen=REF_CHOSEN,
        ref_rejected=REF_REJECTED, beta=DEFAULT_BETA[kind],
    ).loss.sum().backward()  # fmt: skip
    assert (chosen.grad < 0).all()  # descending the loss raises log π(chosen)
    assert (rejected.grad > 0).all()


def test_sequence_log_probs_sum_over_loss_tokens_only():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    mask = torch.tensor([[True, True, False], [False, True, True]])
    sums, counts = summed_logprobs(logp, mask)
    assert sums.tolist() == [-3.0, -9.5]
    assert counts.tolist() == [2, 2]
