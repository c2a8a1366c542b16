"""`pg_loss`, GPG's plain policy gradient ℓ = −w·A·logp_θ (no ratio, no clip): loss,
gradient −w·A / denominator and metrics against the loop reference, and a hand example. The
tests shared with the clipped loss (masks, micro-batches, importance modes) run both losses.
"""

from __future__ import annotations

import pytest
import torch

from streamrl.algorithms.policy_losses import pg_loss
from tests.unit.algorithms.loss_reference import (
    AGGREGATIONS,
    IMPORTANCE,
    close,
    correction,
    random_batch,
    ref_kwargs,
    ref_policy,
    run_policy,
)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("importance", IMPORTANCE)
def test_pg_loss_matches_reference(seed, aggregation, importance):
    """GPG loss ℓ = −w·A·logp_θ: loss, gradient −w·A/denominator and metrics match."""
    b = random_batch(seed)
    kwargs = {"importance": importance, "importance_cap": 2.0, "aggregation": aggregation}
    loss, grad, metrics = run_policy("pg", b, **kwargs)
    ref_loss, ref_grad, ref_metrics = ref_policy(**b, kind="pg", **ref_kwargs(kwargs))
    close(loss, ref_loss)
    close(grad, ref_grad)
    for key, value in ref_metrics.items():
        close(metrics[key], value)


def test_pg_loss_hand_example():
    """ℓ = −w·A·logp with w from tis: hand-computed token-mean and gradient."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    prox = torch.tensor([[-1.0, -2.0, -0.5]])
    behav = prox - torch.log(torch.tensor([[1.0, 0.5, 4.0]]))  # w = 1, 0.5, 4 → capped to 2
    adv = torch.tensor([[2.0, -1.0, 1.0]])
    loss, _ = pg_loss(logp, prox, behav, adv, torch.ones(1, 3), correction=correction("tis"))
    loss.backward()
    expected = (-1.0 * 2.0 * -1.0 + -0.5 * -1.0 * -2.0 + -2.0 * 1.0 * -0.5) / 3
    close(loss, expected)
    close(logp.grad, [[-2.0 / 3, 0.5 / 3, -2.0 / 3]])
