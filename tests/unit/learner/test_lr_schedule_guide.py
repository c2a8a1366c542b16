"""The framework guide's learning-rate schedule (eq 57, `learner.schedule: warmup-times-cosine`):
η_t = η_0·min(1, t/t_warmup)·cos(π·t/(2T)), t = 1..T, against the formula evaluated here, and
through the scheduler the learner builds."""

from __future__ import annotations

import math

import pytest
import torch

from streamrl.config.loading import load_config
from streamrl.learner.optim import build_scheduler, lr_factor


def guide(t: int, warmup: int, total: int) -> float:
    warm = min(1.0, t / warmup) if warmup else 1.0
    return warm * math.cos(math.pi * min(t, total) / (2 * total))


@pytest.mark.parametrize(("warmup", "total"), [(3, 10), (0, 7), (10, 10), (1, 1)])
def test_the_factor_is_the_guides_product(warmup, total):
    for t in range(1, total + 3):
        got = lr_factor(t - 1, warmup, total, "warmup-times-cosine", 0.5)
        assert got == pytest.approx(guide(t, warmup, total), abs=1e-12), t


def test_it_warms_up_while_it_already_decays_and_ends_at_zero():
    rates = [lr_factor(s, 4, 20, "warmup-times-cosine", 0.0) for s in range(20)]
    assert rates[:4] == sorted(rates[:4])  # rising through the warm-up
    assert rates[3] < 1.0  # the cosine was already under way: never the full peak
    assert rates[4:] == sorted(rates[4:], reverse=True)
    assert rates[-1] == pytest.approx(0.0, abs=1e-12)


def test_the_learner_config_selects_it_and_the_scheduler_follows_it():
    config = load_config(["dapo", "tiny-cpu"], overrides=["learner.schedule=warmup-times-cosine"])
    assert config.learner.schedule == "warmup-times-cosine"
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=2.0)
    scheduler = build_scheduler(optimizer, 3, 8, schedule="warmup-times-cosine")
    seen = []
    for _ in range(8):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([2.0 * guide(t, 3, 8) for t in range(1, 9)])
