"""The off-policy correction menu (`streamrl.algorithms.correction`, docs/algorithms.md "Off-policy
correction: the full menu") against references written here as plain loops over responses and
tokens: ratio levels, truncated weights at token and sequence level, batch normalisation,
rejection bands at every level, the veto, IcePop, the mismatch metrics (fresh groups only for
kl_k3_fresh), a response without loss tokens and ratios at the safety bound; and the
`algorithm.correction` block with its older `importance` spelling."""

from __future__ import annotations

import math
import re

import pytest
import torch
from pydantic import TypeAdapter, ValidationError

from streamrl.algorithms.config import AlgorithmConfig
from streamrl.algorithms.correction import (
    SAFETY_BOUND,
    correct,
    log_ratio,
    mismatch_metrics,
    ratio,
)
from streamrl.algorithms.correction_config import RolloutCorrection
from streamrl.algorithms.reductions import Extreme, Mean
from tests.unit.algorithms.loss_reference import close, random_batch


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
    veto_frac = got.metrics["mismatch/veto_frac"]  # vetoed responses of those with a loss token
    assert (veto_frac.total.item(), veto_frac.count.item()) == (1.0, 3.0)


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


def _value(metric):
    """A metric's value on its own (a `Mean` divided, an `Extreme`'s value)."""
    if isinstance(metric, Mean):
        return (metric.total / metric.count).item()
    if isinstance(metric, Extreme):
        return metric.value.item()
    return metric.item()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mismatch_metrics_match_the_reference(seed):
    b = random_batch(seed, N=7)
    px, bh, m = _lists(b)
    fresh = [i % 2 == 0 for i in range(len(px))]
    got = mismatch_metrics(b["logp_prox"], b["logp_behav"], b["mask"], torch.tensor(fresh))
    k1 = k3 = count = fresh_k3 = fresh_count = 0.0
    ratios, response_diffs, geometric = [], [], []
    for i in range(len(px)):
        tokens = [t for t in range(len(px[i])) if m[i][t]]
        for t in tokens:
            d = px[i][t] - bh[i][t]
            rho = _clamped_exp(d)
            k1 += bh[i][t] - px[i][t]
            k3 += rho - d - 1.0
            count += 1
            ratios.append(rho)
            if fresh[i]:
                fresh_k3 += rho - d - 1.0
                fresh_count += 1
        if tokens:
            mean_prox = sum(px[i][t] for t in tokens) / len(tokens)
            mean_behav = sum(bh[i][t] for t in tokens) / len(tokens)
            response_diffs.append(mean_prox - mean_behav)
            geometric.append(math.exp(mean_prox - mean_behav))
    expected = {
        "mismatch/kl_k1": k1 / count,
        "mismatch/kl_k3": k3 / count,
        "mismatch/log_ppl_diff": sum(response_diffs) / len(response_diffs),
        "mismatch/ratio_mean": sum(ratios) / len(ratios),
        "mismatch/ratio_min": min(ratios),
        "mismatch/ratio_max": max(ratios),
        "mismatch/seq_ratio_max": max(geometric),
        "mismatch/kl_k3_fresh": fresh_k3 / fresh_count,
    }
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert _value(got[name]) == pytest.approx(value, rel=1e-5, abs=1e-6), name
    assert k3 / count > 0  # the data has a gap: the check could fail


def test_mismatch_metrics_without_fresh_groups_or_loss_tokens_have_no_mean():
    mask = torch.zeros(2, 3)
    got = mismatch_metrics(torch.zeros(2, 3), torch.ones(2, 3), mask, torch.tensor([True, False]))
    assert got["mismatch/kl_k3_fresh"].count.item() == 0  # left out of the step's metrics
    assert got["mismatch/log_ppl_diff"].count.item() == 0
    assert got["mismatch/ratio_max"].value.item() == -math.inf
    assert mismatch_metrics(torch.zeros(1, 1), None, torch.ones(1, 1), torch.ones(1)) == {}


def test_identical_log_probs_show_no_mismatch():
    b = random_batch(3)
    got = mismatch_metrics(b["logp_prox"], b["logp_prox"].clone(), b["mask"], torch.ones(6) > 0)
    for name in ("mismatch/kl_k1", "mismatch/kl_k3", "mismatch/log_ppl_diff"):
        assert _value(got[name]) == pytest.approx(0.0, abs=1e-7)
    for name in ("mismatch/ratio_min", "mismatch/ratio_max", "mismatch/seq_ratio_max"):
        assert _value(got[name]) == pytest.approx(1.0)


@pytest.mark.parametrize("rs_level", ["token", "sequence", "geometric"])
def test_rejected_responses_are_counted_once_each(rs_level):
    b = random_batch(4, N=8)
    px, bh, m = _lists(b)
    band = (1 / 5, 5.0) if rs_level == "sequence" else (1 / 1.3, 1.3)
    got = correct(b["logp_prox"], b["logp_behav"], b["mask"], rs_level=rs_level, rs_band=band)
    rho = ref_ratios(px, bh, m, rs_level)
    scored = [i for i in range(len(m)) if sum(m[i])]
    rejected = [
        i for i in scored if any(m[i][t] and not band[0] <= rho[i][t] <= band[1] for t in range(7))
    ]
    frac = got.metrics["mismatch/rs_seq_frac"]
    assert (frac.total.item(), frac.count.item()) == (len(rejected), len(scored))


@pytest.mark.parametrize("is_level", ["token", "sequence"])
def test_normalised_weights_average_one_over_the_kept_tokens(is_level):
    """w / mean(w): the mean over the kept loss tokens of the batch — here two micro-batches,
    summed by `weight_sums` as the learner sums them over micro-batches and ranks."""
    b = random_batch(5, N=8)
    config = RolloutCorrection(
        is_level=is_level, is_cap=1.5, is_normalize=True, rs_level="token", rs_high=3.0
    )
    halves = (slice(0, 3), slice(3, 8))
    sums = sum(
        config.weight_sums(b["logp_prox"][h], b["logp_behav"][h], b["mask"][h]) for h in halves
    )
    px, bh, m = _lists(b)
    rho, token_rho = ref_ratios(px, bh, m, is_level), ref_ratios(px, bh, m, "token")
    kept = [
        (i, t)
        for i in range(len(m))
        for t in range(len(m[i]))
        if m[i][t] and 1 / 3 <= token_rho[i][t] <= 3.0
    ]
    mean = sum(min(rho[i][t], 1.5) for i, t in kept) / len(kept)
    assert sums[1].item() == len(kept)
    assert (sums[0] / sums[1]).item() == pytest.approx(mean, rel=1e-6)
    weight_mean = float(sums[0] / sums[1])
    got = config.apply(b["logp_prox"], b["logp_behav"], b["mask"], weight_mean)
    normalised = sum(got.weights[i, t].item() for i, t in kept) / len(kept)
    assert normalised == pytest.approx(1.0, rel=1e-6)
    for i, t in kept:
        assert got.weights[i, t].item() == pytest.approx(min(rho[i][t], 1.5) / mean, rel=1e-6)
    plain = RolloutCorrection(is_level=is_level, is_cap=1.5, rs_level="token", rs_high=3.0)
    plain_weights = plain.apply(b["logp_prox"], b["logp_behav"], b["mask"], weight_mean).weights
    torch.testing.assert_close(got.weights * weight_mean, plain_weights)  # only the scale


ALGORITHM = TypeAdapter(AlgorithmConfig)


@pytest.mark.parametrize(
    ("importance", "block"),
    [
        ({"mode": "tis", "cap": 3.0}, {"is_level": "token", "is_cap": 3.0}),
        (
            {"mode": "mask", "cap": 1.5},
            {"is_cap": 1.5, "rs_level": "token", "rs_low": 0.0, "rs_high": 1.5},
        ),
        ({"mode": "none"}, {"method": "none"}),
        ({}, {}),
    ],
)
def test_the_older_importance_block_reads_as_its_correction(importance, block):
    older = ALGORITHM.validate_python({"name": "dapo", "importance": importance})
    newer = ALGORITHM.validate_python({"name": "dapo", "correction": block})
    assert older == newer
    assert "importance" not in older.model_dump()


def test_the_correction_block_refuses_contradictions():
    for block, words in [
        ({"rs_level": "token", "rs_low": 2.0, "rs_high": 1.5}, "rs_low (2.0) must be below"),
        ({"is_level": "none", "is_normalize": True}, "is_normalize needs an importance weight"),
        ({"method": "icepop", "low": 5.0, "high": 0.5}, "low (5.0) must be below high"),
    ]:
        with pytest.raises(ValidationError, match=re.escape(words)):
            ALGORITHM.validate_python({"name": "grpo", "correction": block})
    with pytest.raises(ValidationError, match=r"set algorithm\.correction only"):
        ALGORITHM.validate_python({"name": "grpo", "correction": {}, "importance": {"mode": "tis"}})


def test_the_rejection_band_defaults_to_the_reciprocal_of_its_top():
    assert RolloutCorrection(rs_level="geometric", rs_high=1.25).rejection_band == (0.8, 1.25)


def test_the_k3_kl_of_nearly_agreeing_engines_is_small_and_never_negative():
    """δ ~ 1e-5 (fp32 engines that nearly agree): k3 ≈ δ²/2, where ρ − log ρ − 1 in float32
    rounds to either sign."""
    gen = torch.Generator().manual_seed(0)
    prox = -2.0 * torch.rand(64, 32, generator=gen)
    behav = prox + 1e-5 * torch.randn(64, 32, generator=gen)
    got = mismatch_metrics(prox, behav, torch.ones(64, 32), torch.ones(64) > 0)
    delta = (prox.double() - behav.double()).flatten()
    expected = float((delta.exp() - delta - 1).mean())
    assert 0 <= got["mismatch/kl_k3"].item() == pytest.approx(expected, rel=0.05)
