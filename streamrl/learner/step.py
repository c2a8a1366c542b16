"""One learner step: score a training batch, then one optimiser update per mini-batch.

Consumes a `TrainBatch` and its `MiniBatch`es (`streamrl.learner.mini_batches`); produces updated
parameters (policy, and critic for an algorithm with a value model) and the step's metrics
(names as in docs/algorithms.md).

A step has two passes over this rank's micro-batches:

1. Scoring (`streamrl.learner.scoring`; no grad, before any update): proximal and reference
   log-probs, critic values, and the algorithm's token advantages for every micro-batch.
2. Training: per mini-batch, every rank runs forward and backward on its share of the
   micro-batches (the same number on every rank); each micro-batch's loss is its exact share
   of the mini-batch's (`streamrl.learner.objective`: global denominators), so the gradients
   FSDP sums over ranks are exactly the full mini-batch's gradient, whatever the token budget
   or the world size. The policy and, with a value model, the critic (its own optimiser)
   learn. An update whose gradient norm is not finite is skipped and counted
   (`actor/skipped_updates`, `critic/skipped_updates`); the learner decides when too many in
   a row end the run.

What differs per algorithm (advantages, models, loss terms, denominators) the algorithm's
config says (`streamrl.algorithms.base.AlgorithmBase`); the step has no per-algorithm branch.
Metrics are reduced over ranks once, at the end (`streamrl.learner.step_metrics`).

`train_policy=False` is VAPO's value pre-training: only the critic learns, on the frozen policy's
responses. An EMA reference moves toward the policy after each step that trained it.
"""

from __future__ import annotations

from torch import nn

from streamrl.algorithms.config import AlgorithmConfig
from streamrl.algorithms.kl import ema_update_
from streamrl.algorithms.reductions import StepMetric
from streamrl.learner.mini_batches import MiniBatch, TrainBatch, shard_for_rank
from streamrl.learner.objective import critic_loss, policy_loss
from streamrl.learner.scoring import score_batch
from streamrl.learner.step_inputs import StepModels, StepSettings, Trainable, local_shards
from streamrl.learner.step_metrics import StepMetrics
from streamrl.learner.topology import Topology

# The types of `train_on_batch`'s signature, importable with it.
__all__ = ["StepModels", "StepSettings", "Trainable", "train_on_batch"]


def train_on_batch(
    models: StepModels,
    batch: TrainBatch,
    mini_batches: list[MiniBatch],
    algorithm: AlgorithmConfig,
    settings: StepSettings,
    topology: Topology,
    *,
    train_policy: bool = True,
) -> dict[str, float]:
    """One learner step: an optimiser update per mini-batch (policy unless `train_policy` is
    False; critic when there is one). Returns the step's metrics: losses summed exactly,
    per-token metrics weighted by tokens over every micro-batch of every rank."""
    _check_models(models, algorithm, train_policy)
    _check_batch(batch, algorithm)
    rank, world, device = topology.rank, topology.world_size, topology.device
    micros = [[m.to(device) for m in shard_for_rank(mini, rank, world)] for mini in mini_batches]
    # Several updates share the batch, or the correction needs every weight before the first
    # loss (its batch mean): the proximal log-probs come from a scoring forward pass.
    proximal = train_policy and (len(mini_batches) > 1 or algorithm.correction.normalises)
    responses = batch.responses(mini_batches)
    scored, scoring_metrics = score_batch(
        models, responses, micros, algorithm, settings, topology, proximal=proximal
    )

    trained: dict[str, Trainable] = {"actor": models.policy} if train_policy else {}
    if models.critic is not None:
        trained["critic"] = models.critic
    for part in trained.values():
        part.model.train()
    metrics = StepMetrics(device)
    for mini, mine, targets in zip(mini_batches, micros, scored, strict=True):
        for part in trained.values():
            part.zero_grad()
        for micro, target in zip(mine, targets, strict=True):
            micro_metrics: dict[str, StepMetric] = {}
            value_stats = None
            if train_policy:
                loss, micro_metrics = policy_loss(
                    models.policy.model, micro, mini, target, algorithm, settings
                )
                loss.backward()
            if models.critic is not None:
                loss, critic_metrics, value_stats = critic_loss(
                    models.critic.model, micro, mini, target, algorithm
                )
                loss.backward()
                micro_metrics.update(critic_metrics)
            metrics.add_micro_batch(micro_metrics, micro.num_tokens, value_stats)
        for prefix, part in trained.items():
            metrics.add_update(prefix, part.update(settings.grad_clip))
    kl = algorithm.reference_kl
    if train_policy and kl is not None and kl.reference == "ema":
        _ema_update(models.reference, models.policy.model, kl.ema_tau)
    return scoring_metrics | metrics.reduce(topology, trained, len(mini_batches))


def _check_models(models: StepModels, algorithm: AlgorithmConfig, train_policy: bool) -> None:
    """The step has the models the algorithm needs, and a critic only where it has one."""
    if algorithm.uses_value_model and models.critic is None:
        raise ValueError(f"algorithm '{algorithm.name}' needs a critic; none was given")
    if not algorithm.uses_value_model and models.critic is not None:
        raise ValueError(f"algorithm '{algorithm.name}' has no value model; a critic was given")
    if algorithm.needs_reference and models.reference is None:
        raise ValueError(
            f"algorithm '{algorithm.name}' has a KL term but no reference policy was given"
        )
    if not train_policy and models.critic is None:
        raise ValueError("train_policy=False (value pre-training) needs a critic")


def _check_batch(batch: TrainBatch, algorithm: AlgorithmConfig) -> None:
    """The algorithm can train on every group of the batch (multi-turn groups, teacher
    log-probs for on-policy distillation)."""
    if algorithm.opd is not None and batch.teacher_logprobs is None:
        raise ValueError(
            "algorithm.opd (on-policy distillation) trains on teacher log-probs, but this "
            "batch's groups carry none: give the generators a teacher (generator.teacher), or "
            "set algorithm.opd=null"
        )
    reason = algorithm.multi_turn_refusal
    if reason is None:
        return
    group = next((g for g in batch.groups if g.is_multi_turn), None)
    if group is not None:
        raise ValueError(
            f"algorithm '{algorithm.name}' cannot train on multi-turn group {group.prompt_id!r} "
            f"from generator {group.generator_id!r}: {reason}. Train agents (environments, "
            "tools) with an outcome-advantage algorithm (grpo, dr_grpo, dapo, rloo, "
            f"reinforce_pp, gpg), or give {algorithm.name} single-turn rollouts"
        )


def _ema_update(reference: nn.Module, policy: nn.Module, tau: float) -> None:
    """θ_ref ← τ·θ_ref + (1 − τ)·θ on this rank's shards (both models are sharded alike)."""
    ema_update_(local_shards(reference), local_shards(policy), tau)
