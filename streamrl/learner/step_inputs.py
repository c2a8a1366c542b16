"""What a learner step works with: its settings and its models, each trainable one with its
optimiser and schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from streamrl.learner.optim import clip_grad_norm

if TYPE_CHECKING:
    from streamrl.config.run import RunConfig

__all__ = ["StepModels", "StepSettings", "Trainable", "ValuePrior", "local_shards"]


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
class ValuePrior:
    """The frozen pre-trained critic V_pre of weighted value integration (the guide's eqs
    17–18) and this step's weight w on it: the policy's GAE runs on `blend` of the critic's
    values. `model` is sharded like the critic; `freeze` copies the critic into it."""

    model: nn.Module
    weight: float = 0.0

    def blend(self, critic_values: torch.Tensor, prior_values: torch.Tensor) -> torch.Tensor:
        """V_aug = w·V_pre + (1 − w)·V_critic."""
        return self.weight * prior_values + (1.0 - self.weight) * critic_values

    @torch.no_grad()
    def freeze(self, critic: nn.Module) -> None:
        """V_pre ← the critic as it is now (this rank's shards; both are sharded alike)."""
        for prior, live in zip(local_shards(self.model), local_shards(critic), strict=True):
            prior.copy_(live)


def local_shards(module: nn.Module) -> list[torch.Tensor]:
    """This rank's shard of each of `module`'s parameters, in `parameters()` order: FSDP2
    parameters are DTensors. An FSDP2 root keeps its own parameters gathered after a forward
    pass without backward (a frozen model's), and writes to those would be lost at the next
    reshard: it is resharded first, so that the shards are the parameters themselves."""
    if isinstance(module, FSDPModule):
        module.reshard()
    return [p.to_local() if hasattr(p, "to_local") else p for p in module.parameters()]


@dataclass
class StepModels:
    """The models a step uses: the policy (always), the critic (an algorithm with a value
    model), the reference policy (a KL term: frozen initial weights or an EMA of the policy),
    the frozen pre-trained critic (weighted value integration)."""

    policy: Trainable
    critic: Trainable | None = None
    reference: nn.Module | None = None
    value_prior: ValuePrior | None = None

    def trainables(self) -> dict[str, Trainable]:
        """The models that learn, by metric prefix (`actor`, `critic`)."""
        parts = {"actor": self.policy}
        if self.critic is not None:
            parts["critic"] = self.critic
        return parts
