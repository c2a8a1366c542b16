"""One learner step: a training batch's advantages, then one optimiser update per mini-batch.

Consumes a `TrainBatch` and its `MiniBatch`es (`streamrl.learner.batching`); produces updated
parameters and the step's metrics (names as in ALGORITHMS.md).

Per mini-batch, every rank runs forward and backward on its share of the micro-batches (the
same number on every rank) and each micro-batch's loss is divided by the mini-batch's GLOBAL
denominators (tokens, or responses, over all its micro-batches on all ranks), so the summed
gradients — FSDP reduces by sum — are exactly the full mini-batch's gradient, whatever the
token budget or the world size.

Proximal log-probs: with one update per batch, logp_prox = logp_θ.detach() (ratio 1, same
gradient) and no extra forward pass; with several, one no-grad pass before the first update
records the weights at the start of the step (ALGORITHMS.md, "Policy loss").

Supported here: the outcome-advantage algorithms (grpo, dr_grpo, dapo, rloo, gpg). The
critic (vapo) and reference-policy terms (KL, reinforce_pp) need models this module does not
load yet and are refused with a clear error.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from streamrl.algorithms import (
    aggregate,
    broadcast_to_tokens,
    dr_grpo_advantages,
    entropy_from_logits,
    gpg_advantages,
    grpo_advantages,
    masked_mean,
    pg_loss,
    ppo_policy_loss,
    rloo_advantages,
    token_logprobs,
)
from streamrl.algorithms.config import AlgorithmConfig
from streamrl.learner.batching import MicroBatch, MiniBatch, TrainBatch, shard_for_rank
from streamrl.learner.optim import clip_grad_norm
from streamrl.learner.topology import Topology

__all__ = ["StepSettings", "compute_advantages", "micro_batch_loss", "train_on_batch"]

_OUTCOME_ESTIMATORS = {
    "grpo": grpo_advantages,
    "dapo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
}


@dataclass(frozen=True)
class StepSettings:
    """What a step needs beyond the algorithm: sampling temperature (the learner scores the
    distribution the generator sampled from), L_max for seq-mean-token-sum-norm, the
    log-prob chunk size and gradient clipping."""

    temperature: float
    max_response_len: int
    logprob_chunk_tokens: int = 1024
    grad_clip: float | None = 1.0


def compute_advantages(algorithm: AlgorithmConfig, batch: TrainBatch) -> Tensor:
    """Per-response outcome advantages of the whole batch. `[N]` float32."""
    _check_supported(algorithm)
    rewards = torch.as_tensor(batch.rewards, dtype=torch.float32)
    groups = torch.as_tensor(batch.group_index, dtype=torch.int64)
    if algorithm.name == "gpg":
        advantages, _ = gpg_advantages(rewards, groups, batch.num_groups)
        return advantages
    if algorithm.name in {"grpo", "dapo"}:
        return grpo_advantages(rewards, groups, batch.num_groups, eps=algorithm.std_eps)
    return _OUTCOME_ESTIMATORS[algorithm.name](rewards, groups, batch.num_groups)


def _check_supported(algorithm: AlgorithmConfig) -> None:
    if algorithm.uses_value_model or algorithm.name == "reinforce_pp":
        raise ValueError(
            f"the learner does not train algorithm '{algorithm.name}' yet (it needs a "
            "critic or a reference policy); use grpo, dr_grpo, dapo, rloo or gpg"
        )
    if getattr(algorithm, "kl", None) is not None:
        raise ValueError(
            f"algorithm '{algorithm.name}' has a KL term, which needs a reference policy the "
            "learner does not load yet; set algorithm.kl=null"
        )


def _logits(model: nn.Module, micro: MicroBatch) -> Tensor:
    """Logits predicting `micro.targets`: `[n, T − 1, V]`."""
    output = model(input_ids=micro.input_ids, attention_mask=micro.attention_mask)
    return output.logits[:, :-1]


def micro_batch_loss(
    model: nn.Module,
    micro: MicroBatch,
    mini: MiniBatch,
    advantages: Tensor,
    algorithm: AlgorithmConfig,
    settings: StepSettings,
    logp_prox: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's exact share of the mini-batch loss, and its metrics.

    Args:
        advantages: `[N]` per-response advantages of the whole batch.
        logp_prox: `[n, T − 1]` proximal log-probs, or None for logp_θ.detach().
    """
    logits = _logits(model, micro)
    logp = token_logprobs(
        logits,
        micro.targets,
        temperature=settings.temperature,
        chunk_tokens=settings.logprob_chunk_tokens,
    )
    mask = micro.loss_mask
    token_advantages = broadcast_to_tokens(advantages[micro.sample_index], mask)
    prox = logp.detach() if logp_prox is None else logp_prox
    common = {
        "importance": algorithm.importance.mode,
        "importance_cap": algorithm.importance.cap,
        "aggregation": algorithm.aggregation,
        "num_tokens": mini.num_loss_tokens,
        "num_seqs": (
            mini.num_scored_responses
            if algorithm.aggregation == "seq-mean-token-mean"
            else mini.num_responses
        ),
        "max_len": settings.max_response_len,
    }
    behaviour = micro.behaviour_logprobs
    if algorithm.name == "gpg":
        loss, metrics = pg_loss(logp, prox, behaviour, token_advantages, mask, **common)
    else:
        loss, metrics = ppo_policy_loss(
            logp,
            prox,
            behaviour,
            token_advantages,
            mask,
            clip_low=algorithm.clip_low,
            clip_high=algorithm.clip_high,
            dual_clip=algorithm.dual_clip,
            **common,
        )
    entropy = entropy_from_logits(
        logits if algorithm.entropy_coef > 0 else logits.detach(),
        temperature=settings.temperature,
        chunk_tokens=settings.logprob_chunk_tokens,
    )
    if algorithm.entropy_coef > 0:
        bonus = aggregate(entropy, mask, "token-mean", num_tokens=mini.num_loss_tokens)
        loss = loss - algorithm.entropy_coef * bonus
    metrics["actor/entropy"] = masked_mean(entropy.detach(), mask)
    return loss, metrics


@torch.no_grad()
def _proximal_logprobs(
    model: nn.Module, micros: list[list[MicroBatch]], settings: StepSettings
) -> list[list[Tensor]]:
    """log π_prox of every micro-batch of every mini-batch, before the first update."""
    return [
        [
            token_logprobs(
                _logits(model, micro),
                micro.targets,
                temperature=settings.temperature,
                chunk_tokens=settings.logprob_chunk_tokens,
            )
            for micro in mini
        ]
        for mini in micros
    ]


def train_on_batch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    batch: TrainBatch,
    mini_batches: list[MiniBatch],
    algorithm: AlgorithmConfig,
    settings: StepSettings,
    topology: Topology,
) -> dict[str, float]:
    """One learner step: an optimiser update per mini-batch. Returns the step's metrics,
    token-weighted over every micro-batch of every rank (the loss summed: it is exact)."""
    advantages = compute_advantages(algorithm, batch)
    micros = [shard_for_rank(mini, topology.rank, topology.world_size) for mini in mini_batches]
    prox = _proximal_logprobs(model, micros, settings) if len(mini_batches) > 1 else None
    weighted: dict[str, Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
    tokens = torch.zeros((), dtype=torch.float64)
    loss_sum = torch.zeros((), dtype=torch.float64)
    grad_norms = []
    model.train()
    for m, (mini, mine) in enumerate(zip(mini_batches, micros, strict=True)):
        optimizer.zero_grad(set_to_none=True)
        for j, micro in enumerate(mine):
            logp_prox = None if prox is None else prox[m][j]
            loss, metrics = micro_batch_loss(
                model, micro, mini, advantages, algorithm, settings, logp_prox
            )
            loss.backward()
            loss_sum += loss.detach().double()
            for name, value in metrics.items():
                if name != "actor/pg_loss":
                    weighted[name] += value.double() * micro.num_tokens
            tokens += micro.num_tokens
        grad_norms.append(clip_grad_norm(model, settings.grad_clip))
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    names = sorted(weighted)
    totals = topology.all_reduce_sum(torch.stack([tokens, loss_sum, *(weighted[n] for n in names)]))
    total_tokens = max(float(totals[0]), 1.0)
    out = {name: float(value) / total_tokens for name, value in zip(names, totals[2:], strict=True)}
    out["actor/pg_loss"] = float(totals[1]) / len(mini_batches)
    out["actor/grad_norm"] = sum(grad_norms) / len(grad_norms)
    out["actor/lr"] = optimizer.param_groups[0]["lr"]
    return out
