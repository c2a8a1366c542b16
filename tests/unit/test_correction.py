"""The off-policy correction menu (`streamrl.algorithms.correction`, ALGORITHMS.md "Off-policy
correction: the full menu") against references written here as plain loops over responses and
tokens: ratio levels, truncated weights at token and sequence level, rejection bands at every
level, the veto, IcePop, a response without loss tokens and ratios at the safety bound."""

from __future__ import annotations

import math

import pytest
import torch

from streamrl.algorithms.correction import SAFETY_BOUND, correct, log_ratio, ratio
from tests.unit.loss_reference import close, random_batch


def _clamped_exp(x: float) -> float:
    return math.exp(max(-SAFETY_BOUND, min(SAFETY_BOUND, x)))


def ref_ratios(px, bh, m, level):
    """ρ per token of every response, one response and one token at a time."""
    out = []
    for i in range(len(px)):
        deltas = [px[i][t] - bh[i][t] if m[i][t] else 0.0 for t in range(len(px[i]))]
        if level == "token":
            out.append([_clamped_exp(d) for d in deltas])
            continue
        total = sum(max(-SAFETY_BOUND, min(SAFETY_BOUND, d)) for d in deltas)
        count = sum(1 for t in range(len(px[i])) if m[i][t])
        if level == "geometric":
            total = total / count if count else 0.0
        out.append([_clamped_exp(total)] * len(px[i]))
    return out


def _lists(b):
    return b["logp_prox"].tolist(), b["logp_behav"].tolist(), b["mask"].tolist()


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("seed", [0, 1])
def test_ratio_levels_match_the_reference(level, seed):
    b = random_batch(seed)
    px, bh, m = _lists(b)
    delta = log_ratio(b["logp_prox"], b["logp_behav"], b["mask"])
    got = ratio(delta, b["mask"], level)
    expected = ref_ratios(px, bh, m, level)
    masked = [[e if m[i][t] else 0.0 for t, e in enumerate(r)] for i, r in enumerate(expected)]
    close(got * b["mask"], masked)


def test_a_response_without_loss_tokens_has_geometric_ratio_one():
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    delta = torch.tensor([[0.5, 0.5], [3.0, -7.0]])
    assert ratio(delta * mask, mask, "geometric")[1].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("is_level", ["token", "sequence"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_truncated_weights_match_the_reference(is_level, seed):
    b = random_batch(seed)
    px, bh, m = _lists(b)
    got = correct(b["logp_prox"], b["logp_behav"], b["mask"], is_level=is_level, is_cap=1.5)
    rho = ref_ratios(px, bh, m, is_level)
    expected = [[min(r, 1.5) * m[i][t] for t, r in enumerate(row)] for i, row in enumerate(rho)]
    close(got.weights * b["mask"], expected)
    close(got.mask, m)  # truncation rejects nothing
    clipped = [[1.0 if r > 1.5 else 0.0 for r in row] for row in rho]
    count = sum(sum(row) for row in m)
    frac = sum(clipped[i][t] * m[i][t] for i in range(len(m)) for t in range(len(m[i]))) / count
    close(got.metrics["actor/is_clip_frac"], frac)


@pytest.mark.parametrize("rs_level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rejection_bands_match_the_reference(rs_level, seed):
    b = random_batch(seed)
    px, bh, m = _lists(b)
    band = (1 / 5, 5.0) if rs_level == "sequence" else (1 / 1.3, 1.3)  # some kept, some not
    got = correct(b["logp_prox"], b["logp_behav"], b["mask"], rs_level=rs_level, rs_band=band)
    rho = ref_ratios(px, bh, m, rs_level)
    kept = [
        [m[i][t] if band[0] <= r <= band[1] else 0.0 for t, r in enumerate(row)]
        for i, row in enumerate(rho)
    ]
    close(got.mask, kept)
    rejected = sum(m[i][t] - kept[i][t] for i in range(len(m)) for t in range(len(m[i])))
    assert 0 < rejected < sum(sum(row) for row in m)
    close(got.metrics["mismatch/rs_token_frac"], rejected / sum(sum(row) for row in m))


def test_the_veto_drops_whole_responses_with_a_catastrophic_token():
    prox = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    # response 0: one token with ratio e^-12 < 1e-4; response 1: the same token masked out;
    # response 2: e^-9 > 1e-4, kept.
    behav = torch.tensor([[-1.0, 11.0, -1.0], [-1.0, 11.0, -1.0], [-1.0, 8.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    got = correct(prox, behav, mask, veto=1e-4)
    assert got.mask.tolist() == [[0.0, 0.0, 0.0], [1.0, 0.0, 1.0], [1.0, 1.0, 0.0]]
    close(got.metrics["mismatch/veto_frac"], 3 / 7)


def test_the_veto_reads_the_unclamped_ratio():
    """e^-30 is below τ even though the weight's exponent is clamped at −20."""
    got = correct(torch.tensor([[-31.0]]), torch.tensor([[-1.0]]), torch.ones(1, 1), veto=1e-12)
    assert got.mask.tolist() == [[0.0]]
    assert got.weights.item() == pytest.approx(math.exp(-SAFETY_BOUND))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_icepop_masks_outside_its_band_and_weights_inside_without_truncation(seed):
    b = random_batch(seed)
    px, bh, m = _lists(b)
    got = correct(b["logp_prox"], b["logp_behav"], b["mask"], icepop=(0.5, 5.0), is_cap=1.0)
    rho = ref_ratios(px, bh, m, "token")
    inside = [[1.0 if 0.5 <= r <= 5.0 else 0.0 for r in row] for row in rho]
    close(got.mask, [[inside[i][t] * m[i][t] for t in range(len(m[i]))] for i in range(len(m))])
    expected = [
        [rho[i][t] * inside[i][t] * m[i][t] for t in range(len(m[i]))] for i in range(len(m))
    ]
    close(got.weights * b["mask"], expected)


def test_ratios_at_the_safety_bound_stay_finite():
    prox = torch.tensor([[0.0, 0.0], [-500.0, 0.0]])
    behav = torch.tensor([[-500.0, -500.0], [0.0, 0.0]])
    mask = torch.ones(2, 2)
    for level in ("token", "sequence", "geometric"):
        rho = ratio(log_ratio(prox, behav, mask), mask, level)
        assert torch.isfinite(rho).all()
        assert rho.max().item() == pytest.approx(math.exp(SAFETY_BOUND))
    got = correct(prox, behav, mask, is_level="sequence", is_cap=3.0)
    assert got.weights.tolist()[0] == [3.0, 3.0]


def test_on_policy_is_weight_one_and_rejects_nothing():
    mask = torch.tensor([[1.0, 0.0]])
    got = correct(torch.tensor([[-2.0, 5.0]]), None, mask, rs_level="token", rs_band=(0.9, 1.1))
    assert got.weights.tolist() == [[1.0, 1.0]]
    assert got.mask.tolist() == [[1.0, 0.0]]
