"""How a step metric that is not a token mean is reduced over every micro-batch of every rank.

A learner step's metrics are gathered per micro-batch and reduced once over ranks
(`streamrl.learner.step_metrics`). A plain scalar tensor is a token mean over the micro-batch's
loss tokens (weighted by them). The forms here say otherwise:

* `Mean(total, count)`: Σ total / Σ count over the whole step (a mean over responses, or over
  the tokens of fresh groups only); left out of the step's metrics when Σ count = 0.
* `Extreme(value, largest)`: the largest (or smallest) value anywhere in the step; left out
  when no micro-batch had one (`value` is ∓inf for an empty micro-batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Extreme", "Mean", "StepMetric"]


@dataclass(frozen=True)
class Mean:
    """Σ total / Σ count over the step (scalars, detached)."""

    total: Tensor
    count: Tensor


@dataclass(frozen=True)
class Extreme:
    """The step's maximum of `value` (`largest`) or its minimum."""

    value: Tensor
    largest: bool = True

    @classmethod
    def of(cls, x: Tensor, mask: Tensor, *, largest: bool) -> Extreme:
        """The max (min) of `x` where `mask` ≠ 0; ∓inf when the mask is empty."""
        empty = -torch.inf if largest else torch.inf
        chosen = torch.where(mask != 0, x.float(), empty)
        reduced = chosen.max() if largest else chosen.min()
        return cls(reduced.detach() if chosen.numel() else torch.tensor(empty), largest)


StepMetric = Tensor | Mean | Extreme
