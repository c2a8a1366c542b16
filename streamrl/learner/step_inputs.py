"""What a learner step works with: its settings and its models, each trainable one with its
optimiser and schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from streamrl.learner.optim import clip_grad_norm

if TYPE_CHECKING:
    from streamrl.config import RunConfig

__all__ = ["StepModels", "StepSettings", "Trainable"]


@dataclass(frozen=True)
class StepSettings:
    """What a step needs beyond the algorithm: sampling temperature (the learner scores the
    distribution the generator sampled from), L_max for seq-mean-token-sum-norm, the
    log-prob chunk size and gradient clipping."""

    temperature: float
    max_response_len: int
    logprob_chunk_tokens: int = 1024
    grad_clip: float | None = 1.0

    @classmethod
    def from_config(cls, config: RunConfig) -> StepSettings:
        """The learner's settings for `config`: the generators' temperature and L_max."""
        return cls(
            temperature=config.generator.temperature,
            max_response_len=config.generator.max_tokens,
            logprob_chunk_tokens=config.learner.logprob_chunk_tokens,
            grad_clip=config.learner.grad_clip,
        )


@dataclass
class Trainable:
    """A model with its optimiser and (optional) learning-rate schedule, and the count of
    updates skipped for a non-finite gradient: in a row (reset by an applied update) and in
    all (the learner checkpoints both)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    skipped_in_a_row: int = 0
    skipped_total: int = 0

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def update(self, grad_clip: float | None) -> tuple[float, bool]:
        """Clip, step, advance the schedule: the gradient norm before clipping, and whether the
        update was applied.

        A non-finite norm (NaN/inf anywhere in the gradients, the same verdict on every rank:
        the norm is global) skips the update: the gradients are zeroed and neither the
        parameters, the optimiser moments nor the schedule move."""
        norm = clip_grad_norm(self.model, grad_clip)
        if not math.isfinite(norm):
            self.zero_grad()
            self.skipped_in_a_row += 1
            self.skipped_total += 1
            return norm, False
        self.skipped_in_a_row = 0
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        return norm, True

    @property
    def lr(self) -> float:
        """The learning rate of the next update (the first parameter group's)."""
        return self.optimizer.param_groups[0]["lr"]


@dataclass
class StepModels:
    """The models a step uses: the policy (always), the critic (an algorithm with a value
    model), the reference policy (a KL term: frozen initial weights or an EMA of the policy)."""

    policy: Trainable
    critic: Trainable | None = None
    reference: nn.Module | None = None

    def trainables(self) -> dict[str, Trainable]:
        """The models that learn, by metric prefix (`actor`, `critic`)."""
        parts = {"actor": self.policy}
        if self.critic is not None:
            parts["critic"] = self.critic
        return parts
