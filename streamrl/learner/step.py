"""One learner step: score a training batch, then one optimiser update per mini-batch.

Consumes a `TrainBatch` and its `MiniBatch`es (`streamrl.learner.batching`); produces updated
parameters (policy, and critic for VAPO) and the step's metrics (names as in ALGORITHMS.md).

A step has two passes over this rank's micro-batches:

1. Scoring (no grad, before any update): what the losses compare against — proximal log-probs
   when several updates share the batch (with one, logp_prox = logp_θ.detach(): ratio 1, same
   gradient, no extra forward pass); reference log-probs when a KL term is configured; critic
   values V_old for VAPO. From them, token advantages `[n, T−1]` for every micro-batch:
   - grpo, dr_grpo, dapo, rloo, gpg: the response's outcome advantage on each of its tokens;
   - reinforce_pp: reward-to-go of R_i − β·KL_t (KL of the behaviour policy, which sampled the
     tokens, to the reference), whitened over the valid tokens of the whole batch on all ranks;
   - vapo: length-adaptive GAE on V_old (policy), value targets with λ_critic.
2. Training: per mini-batch, every rank runs forward and backward on its share of the
   micro-batches (the same number on every rank) and divides each micro-batch's loss by the
   mini-batch's GLOBAL denominators (tokens or responses over all its micro-batches on all
   ranks), so the gradients FSDP sums over ranks are exactly the full mini-batch's gradient,
   whatever the token budget or the world size. Policy loss (+ β·KL, + μ·NLL of correct
   responses, − c_H·entropy); for VAPO the critic's clipped value loss, its own optimiser.
   An update whose gradient norm is not finite is skipped and counted
   (`actor/skipped_updates`, `critic/skipped_updates`); the learner decides when too many in a
   row end the run.

`train_policy=False` is VAPO's value pre-training: only the critic learns, on the frozen policy's
responses. An EMA reference moves toward the policy after each step that trained it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from streamrl.algorithms import (
    aggregate,
    broadcast_to_tokens,
    dr_grpo_advantages,
    ema_update_,
    entropy_from_logits,
    gpg_advantages,
    grpo_advantages,
    kl_estimate,
    masked_mean,
    masked_whiten,
    pg_loss,
    positive_nll_loss,
    ppo_policy_loss,
    reinforce_pp_returns,
    rloo_advantages,
    token_logprobs,
    token_logprobs_and_entropy,
    value_loss,
    vapo_advantages,
)
from streamrl.algorithms.config import AlgorithmConfig, KLConfig, ReinforcePPConfig, VAPOConfig
from streamrl.algorithms.masked import group_mean
from streamrl.learner.batching import MicroBatch, MiniBatch, TrainBatch, shard_for_rank
from streamrl.learner.optim import clip_grad_norm
from streamrl.learner.topology import Topology

__all__ = [
    "MicroTargets",
    "StepModels",
    "StepSettings",
    "Trainable",
    "critic_loss",
    "outcome_advantages",
    "policy_loss",
    "score_batch",
    "train_on_batch",
]

# Losses that are each micro-batch's exact share of the mini-batch's value: summed, not averaged.
_EXACT = ("actor/pg_loss", "actor/kl_loss", "actor/nll_loss", "critic/vf_loss")


@dataclass(frozen=True)
class StepSettings:
    """What a step needs beyond the algorithm: sampling temperature (the learner scores the
    distribution the generator sampled from), L_max for seq-mean-token-sum-norm, the
    log-prob chunk size and gradient clipping."""

    temperature: float
    max_response_len: int
    logprob_chunk_tokens: int = 1024
    grad_clip: float | None = 1.0


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


@dataclass
class StepModels:
    """The models a step uses: the policy (always), the critic (vapo), the reference policy
    (a KL term: frozen initial weights or an EMA of the policy)."""

    policy: Trainable
    critic: Trainable | None = None
    reference: nn.Module | None = None


@dataclass(frozen=True)
class MicroTargets:
    """A micro-batch's scoring-pass results, all `[n, T−1]` float32 (zero off the response).

    advantages      per-token advantages
    logp_prox       proximal log-probs, or None: use logp_θ.detach()
    logp_ref        reference log-probs (a KL term), or None
    old_values      critic values when scored (vapo), or None
    value_targets   critic targets (vapo), or None
    """

    advantages: Tensor
    logp_prox: Tensor | None = None
    logp_ref: Tensor | None = None
    old_values: Tensor | None = None
    value_targets: Tensor | None = None


def _kl(algorithm: AlgorithmConfig) -> KLConfig | None:
    return getattr(algorithm, "kl", None)


def needs_reference(algorithm: AlgorithmConfig) -> bool:
    """Whether the algorithm compares the policy with a reference policy (a KL term)."""
    return _kl(algorithm) is not None


# -- scoring ---------------------------------------------------------------------------------


def outcome_advantages(algorithm: AlgorithmConfig, batch: TrainBatch) -> Tensor | None:
    """Per-response outcome advantages of the whole batch, `[N]` float32; None for the
    algorithms whose advantages are per token (reinforce_pp, vapo)."""
    rewards = batch.rewards.float()
    groups, num_groups = batch.group_index, batch.num_groups
    match algorithm.name:
        case "grpo" | "dapo":
            return grpo_advantages(rewards, groups, num_groups, eps=algorithm.std_eps)
        case "dr_grpo":
            return dr_grpo_advantages(rewards, groups, num_groups)
        case "rloo":
            return rloo_advantages(rewards, groups, num_groups)
        case "gpg":
            return gpg_advantages(rewards, groups, num_groups, batch.raw_scores)[0]
    return None


def _logits(model: nn.Module, micro: MicroBatch) -> Tensor:
    """Logits predicting `micro.targets`: `[n, T − 1, V]`."""
    output = model(input_ids=micro.input_ids, attention_mask=micro.attention_mask)
    return output.logits[:, :-1]


def _logprobs(model: nn.Module, micro: MicroBatch, settings: StepSettings) -> Tensor:
    return token_logprobs(
        _logits(model, micro),
        micro.targets,
        temperature=settings.temperature,
        chunk_tokens=settings.logprob_chunk_tokens,
    )


def _values(critic: nn.Module, micro: MicroBatch) -> Tensor:
    """V of the state each target token is chosen in: `[n, T − 1]` float32."""
    return critic(input_ids=micro.input_ids, attention_mask=micro.attention_mask)[:, :-1]


@torch.no_grad()
def score_batch(
    models: StepModels,
    batch: TrainBatch,
    micros: list[list[MicroBatch]],
    algorithm: AlgorithmConfig,
    settings: StepSettings,
    topology: Topology,
    *,
    proximal: bool,
) -> tuple[list[list[MicroTargets]], dict[str, float]]:
    """The scoring pass over this rank's micro-batches (`micros[mini][j]`, on the device).

    Returns their `MicroTargets` in the same layout and the scoring metrics (reference KL)."""
    outcome = outcome_advantages(algorithm, batch)
    kl_cfg = _kl(algorithm)
    reference = models.reference if kl_cfg is not None else None
    rewards = batch.rewards.float().to(topology.device)
    if isinstance(algorithm, ReinforcePPConfig) and algorithm.baseline:
        index = batch.group_index.to(topology.device)
        rewards = rewards - group_mean(rewards, index, batch.num_groups)[index]
    if outcome is not None:
        outcome = outcome.to(topology.device)

    scored: list[list[MicroTargets]] = []
    kl_sum = torch.zeros((), dtype=torch.float64, device=topology.device)
    for mini in micros:
        row = []
        for micro in mini:
            logp_prox = _logprobs(models.policy.model, micro, settings) if proximal else None
            logp_ref = None
            if reference is not None:
                logp_ref = _logprobs(reference, micro, settings)
                kl = kl_estimate(micro.behaviour_logprobs, logp_ref, kl_cfg.estimator)
                kl_sum += (kl * micro.loss_mask).sum().double()
            old_values = value_targets = None
            if outcome is not None:
                advantages = broadcast_to_tokens(outcome[micro.sample_index], micro.response_mask)
            elif isinstance(algorithm, ReinforcePPConfig):
                in_reward = kl_cfg is not None and kl_cfg.placement == "reward"
                advantages = reinforce_pp_returns(
                    rewards[micro.sample_index],
                    micro.response_mask,
                    kl_estimate(micro.behaviour_logprobs, logp_ref, kl_cfg.estimator)
                    if in_reward
                    else None,
                    kl_cfg.coef if in_reward else 0.0,
                )
            elif isinstance(algorithm, VAPOConfig):
                old_values = _values(models.critic.model, micro)
                advantages, value_targets = vapo_advantages(
                    micro.rewards,
                    old_values,
                    micro.response_mask,
                    gamma=algorithm.gamma,
                    lam_critic=algorithm.lam_critic,
                    alpha=algorithm.length_alpha,
                )
            else:  # pragma: no cover - the config's union is exhaustive
                raise ValueError(f"no advantage estimator for algorithm {algorithm.name!r}")
            row.append(MicroTargets(advantages, logp_prox, logp_ref, old_values, value_targets))
        scored.append(row)

    if isinstance(algorithm, ReinforcePPConfig):
        scored = _whiten_advantages(scored, micros, topology)
    metrics = {}
    if reference is not None:
        tokens = sum(m.num_tokens for mini in micros for m in mini)
        totals = topology.all_reduce_sum(torch.stack([kl_sum, kl_sum.new_tensor(tokens)]))
        metrics["actor/ref_kl"] = float(totals[0] / totals[1].clamp(min=1.0))
    return scored, metrics


def _whiten_advantages(
    scored: list[list[MicroTargets]], micros: list[list[MicroBatch]], topology: Topology
) -> list[list[MicroTargets]]:
    """REINFORCE++: whiten the returns over the loss tokens of the whole batch on all ranks."""
    flat = torch.cat(
        [
            t.advantages[m.loss_mask]
            for ts, ms in zip(scored, micros, strict=True)
            for t, m in zip(ts, ms, strict=True)
        ]
    )[None]
    group = dist.group.WORLD if topology.world_size > 1 else None
    pieces = iter(
        masked_whiten(flat, torch.ones_like(flat), process_group=group)[0].split(
            [m.num_tokens for ms in micros for m in ms]
        )
    )
    result = []
    for ts, ms in zip(scored, micros, strict=True):
        row = []
        for t, m in zip(ts, ms, strict=True):
            advantages = torch.zeros_like(t.advantages)
            advantages[m.loss_mask] = next(pieces)
            row.append(MicroTargets(advantages, t.logp_prox, t.logp_ref))
        result.append(row)
    return result


# -- losses ----------------------------------------------------------------------------------


def policy_loss(
    model: nn.Module,
    micro: MicroBatch,
    mini: MiniBatch,
    targets: MicroTargets,
    algorithm: AlgorithmConfig,
    settings: StepSettings,
) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's exact share of the mini-batch's policy loss, and its metrics."""
    logits = _logits(model, micro)
    chunk, temperature = settings.logprob_chunk_tokens, settings.temperature
    if algorithm.entropy_coef > 0:  # the entropy is a loss term: it needs its own gradient
        logp = token_logprobs(logits, micro.targets, temperature=temperature, chunk_tokens=chunk)
        entropy = entropy_from_logits(logits, temperature=temperature, chunk_tokens=chunk)
    else:  # one fused pass; the entropy is only a metric
        logp, entropy = token_logprobs_and_entropy(
            logits, micro.targets, temperature=temperature, chunk_tokens=chunk
        )
    mask = micro.loss_mask
    prox = logp.detach() if targets.logp_prox is None else targets.logp_prox
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
        loss, metrics = pg_loss(logp, prox, behaviour, targets.advantages, mask, **common)
    else:
        loss, metrics = ppo_policy_loss(
            logp,
            prox,
            behaviour,
            targets.advantages,
            mask,
            clip_low=algorithm.clip_low,
            clip_high=algorithm.clip_high,
            dual_clip=algorithm.dual_clip,
            **common,
        )
    kl_cfg = _kl(algorithm)
    if kl_cfg is not None and kl_cfg.placement == "loss":
        kl = kl_estimate(logp, targets.logp_ref, kl_cfg.estimator)
        kl_loss = aggregate(kl, mask, "token-mean", num_tokens=mini.num_loss_tokens)
        loss = loss + kl_cfg.coef * kl_loss
        metrics["actor/kl_loss"] = kl_loss.detach()
    if isinstance(algorithm, VAPOConfig) and algorithm.nll_coef > 0:
        nll, nll_metrics = positive_nll_loss(
            logp, mask, micro.positive, num_tokens=mini.num_positive_tokens
        )
        loss = loss + algorithm.nll_coef * nll
        metrics.update(nll_metrics)
    if algorithm.entropy_coef > 0:
        bonus = aggregate(entropy, mask, "token-mean", num_tokens=mini.num_loss_tokens)
        loss = loss - algorithm.entropy_coef * bonus
    metrics["actor/entropy"] = masked_mean(entropy.detach(), mask)
    return loss, metrics


def critic_loss(
    critic: nn.Module, micro: MicroBatch, mini: MiniBatch, targets: MicroTargets, clip: float
) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    """This micro-batch's share of the mini-batch's clipped value loss, its metrics, and its
    explained-variance statistics (see `_explained_variance`)."""
    values = _values(critic, micro)
    loss, metrics = value_loss(
        values,
        targets.old_values,
        targets.value_targets,
        micro.loss_mask,
        clip=clip,
        num_tokens=mini.num_loss_tokens,
    )
    del metrics["critic/explained_var"]  # not additive over micro-batches: from the statistics
    mask = micro.loss_mask.double()
    target, residual = targets.value_targets.double(), (targets.value_targets - values).double()
    stats = torch.stack(
        [
            mask.sum(),
            (target * mask).sum(),
            (target * target * mask).sum(),
            (residual * mask).sum(),
            (residual * residual * mask).sum(),
        ]
    ).detach()
    return loss, metrics, stats


def _explained_variance(stats: Tensor) -> float:
    """1 − Var(V_tgt − V) / Var(V_tgt) from the summed statistics [n, Σt, Σt², Σr, Σr²]."""
    n, st, st2, sr, sr2 = (float(x) for x in stats)
    if n == 0:
        return 0.0
    var_t, var_r = st2 / n - (st / n) ** 2, sr2 / n - (sr / n) ** 2
    return 1.0 - var_r / var_t if var_t > 1e-12 else 0.0


# -- the step --------------------------------------------------------------------------------


def train_on_batch(
    models: StepModels,
    batch: TrainBatch,
    mini_batches: list[MiniBatch],
    algorithm: AlgorithmConfig,
    settings: StepSettings,
    topology: Topology,
    *,
    train_policy: bool = True,
    value_clip: float = 0.5,
) -> dict[str, float]:
    """One learner step: an optimiser update per mini-batch (policy unless `train_policy` is
    False; critic when there is one). Returns the step's metrics: losses summed exactly,
    per-token metrics weighted by tokens over every micro-batch of every rank."""
    if algorithm.uses_value_model and models.critic is None:
        raise ValueError(f"algorithm '{algorithm.name}' needs a critic; none was given")
    if needs_reference(algorithm) and models.reference is None:
        raise ValueError(
            f"algorithm '{algorithm.name}' has a KL term but no reference policy was given"
        )
    if not train_policy and models.critic is None:
        raise ValueError("train_policy=False (value pre-training) needs a critic")
    rank, world, device = topology.rank, topology.world_size, topology.device
    micros = [[m.to(device) for m in shard_for_rank(mini, rank, world)] for mini in mini_batches]
    proximal = train_policy and len(mini_batches) > 1
    scored, out = score_batch(
        models, batch, micros, algorithm, settings, topology, proximal=proximal
    )

    weighted: dict[str, Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
    exact: dict[str, Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
    tokens = torch.zeros((), dtype=torch.float64)
    ev_stats = torch.zeros(5, dtype=torch.float64, device=device)
    updates: dict[str, list[tuple[float, bool]]] = defaultdict(list)  # (grad norm, applied)
    trained = {"actor": models.policy} if train_policy else {}
    if models.critic is not None:
        trained["critic"] = models.critic
    for part in trained.values():
        part.model.train()
    for mini, mine, targets in zip(mini_batches, micros, scored, strict=True):
        for part in trained.values():
            part.zero_grad()
        for micro, target in zip(mine, targets, strict=True):
            metrics: dict[str, Tensor] = {}
            if train_policy:
                loss, metrics = policy_loss(
                    models.policy.model, micro, mini, target, algorithm, settings
                )
                loss.backward()
            if models.critic is not None:
                loss, critic_metrics, stats = critic_loss(
                    models.critic.model, micro, mini, target, value_clip
                )
                loss.backward()
                metrics.update(critic_metrics)
                ev_stats += stats
            for name, value in metrics.items():
                value = value.detach().double().cpu()
                if name in _EXACT:
                    exact[name] += value
                else:
                    weighted[name] += value * micro.num_tokens
            tokens += micro.num_tokens
        for prefix, part in trained.items():
            updates[prefix].append(part.update(settings.grad_clip))
    if train_policy and models.reference is not None and _kl(algorithm).reference == "ema":
        _ema_update(models.reference, models.policy.model, _kl(algorithm).ema_tau)

    w_names, e_names = sorted(weighted), sorted(exact)
    local = torch.stack([tokens, *(weighted[n] for n in w_names), *(exact[n] for n in e_names)])
    totals = topology.all_reduce_sum(local)
    total_tokens = max(float(totals[0]), 1.0)
    for name, value in zip(w_names, totals[1 : 1 + len(w_names)], strict=True):
        out[name] = float(value) / total_tokens
    for name, value in zip(e_names, totals[1 + len(w_names) :], strict=True):
        out[name] = float(value) / len(mini_batches)
    if models.critic is not None:
        out["critic/explained_var"] = _explained_variance(topology.all_reduce_sum(ev_stats))
        out["critic/lr"] = models.critic.optimizer.param_groups[0]["lr"]
    for prefix, results in updates.items():
        out[f"{prefix}/grad_norm"] = sum(norm for norm, _ in results) / len(results)
        out[f"{prefix}/skipped_updates"] = float(sum(not applied for _, applied in results))
        out[f"{prefix}/skipped_updates_total"] = float(trained[prefix].skipped_total)
    if train_policy:
        out["actor/lr"] = models.policy.optimizer.param_groups[0]["lr"]
    return out


def _local(t: Tensor) -> Tensor:
    """A parameter's local shard (FSDP2 parameters are DTensors) or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _ema_update(reference: nn.Module, policy: nn.Module, tau: float) -> None:
    """θ_ref ← τ·θ_ref + (1 − τ)·θ on this rank's shards (both models are sharded alike)."""
    ema_update_(
        (_local(p) for p in reference.parameters()),
        (_local(p) for p in policy.parameters()),
        tau,
    )
