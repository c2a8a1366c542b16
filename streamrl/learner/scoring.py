"""The scoring pass of a learner step: no gradient, before any update, over this rank's
micro-batches.

It computes what the losses compare against: proximal log-probs when several updates share the
batch (with one, logp_prox = logp_θ.detach(): ratio 1, same gradient, no extra forward pass);
reference log-probs when the algorithm has a KL term; the critic's values V_old when it has a
value model (and the frozen pre-trained critic's V_pre, which weighted value integration blends
into the values of the policy's GAE). From them, the algorithm's token advantages `[n, T−1]`
for every micro-batch, in its three stages (`streamrl.algorithms.base.AlgorithmBase`): per
response on the whole batch, per token in each micro-batch, then normalised over every micro-
batch of every rank (REINFORCE++ whitens there). With on-policy distillation (`algorithm.opd`)
the teacher's per-token return is added after that normalisation, never whitened with the
outcome advantages (`streamrl.algorithms.distillation`). When the off-policy correction
normalises its weights, their mean over each mini-batch's kept loss tokens on every rank (one
all-reduce for all mini-batches), from the proximal log-probs it then always computes.

Per token, advantages (and returns) run over the tokens the policy sampled
(`MicroBatch.sampled_mask`): an outcome advantage is broadcast to those only, a reward-to-go
sums their rewards only; normalisation, the reference KL metric and every loss use the
`loss_mask`. Environment tokens of a multi-turn response take part in none of them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor, nn

from streamrl.algorithms.base import Responses
from streamrl.algorithms.config import AlgorithmConfig
from streamrl.algorithms.distillation import opd_metric_sums
from streamrl.algorithms.kl import kl_estimate
from streamrl.learner.forward import token_scores, values
from streamrl.learner.mini_batches import MicroBatch
from streamrl.learner.step_inputs import StepModels, StepSettings
from streamrl.learner.topology import Topology

__all__ = ["MicroTargets", "score_batch"]


@dataclass(frozen=True)
class MicroTargets:
    """A micro-batch's scoring-pass results, all `[n, T−1]` float32 (zero off the sampled
    response tokens).

    advantages      per-token advantages
    logp_prox       proximal log-probs, or None: use logp_θ.detach()
    logp_ref        reference log-probs (a KL term), or None
    old_values      critic values when scored (a value model), or None
    value_targets   critic targets (a value model), or None
    weight_mean     the mini-batch's mean importance weight (a normalising correction)
    """

    advantages: Tensor
    logp_prox: Tensor | None = None
    logp_ref: Tensor | None = None
    old_values: Tensor | None = None
    value_targets: Tensor | None = None
    weight_mean: float | None = None


def _reweighted(
    algorithm: AlgorithmConfig, advantages: Tensor, micro: MicroBatch, responses: Responses
) -> Tensor:
    """The advantages times each response's sequence weight (eq 30), when the algorithm
    reweights."""
    rows = micro.sample_index
    weights = algorithm.sequence_weights(responses.lengths[rows], responses.median_length[rows])
    return advantages if weights is None else advantages * weights.unsqueeze(-1)


def _logprobs(model: nn.Module, micro: MicroBatch, settings: StepSettings) -> Tensor:
    """log p(targets) at `micro`'s sampled response targets, `[n, T − 1]`
    (`forward.token_scores`)."""
    return token_scores(
        model,
        micro,
        temperature=settings.temperature,
        chunk_tokens=settings.logprob_chunk_tokens,
    )[0]


def _values(critic: nn.Module, micro: MicroBatch) -> Tensor:
    """V of the state each sampled response target is chosen in: `[n, T − 1]` float32."""
    return values(critic, micro)


@torch.no_grad()
def score_batch(
    models: StepModels,
    responses: Responses,
    micros: list[list[MicroBatch]],
    algorithm: AlgorithmConfig,
    settings: StepSettings,
    topology: Topology,
    *,
    proximal: bool,
) -> tuple[list[list[MicroTargets]], dict[str, float]]:
    """The scoring pass over this rank's micro-batches (`micros[mini][j]`, on the device).

    Returns their `MicroTargets` in the same layout and the scoring metrics (`actor/ref_kl`,
    the behaviour policy's KL to the reference, when there is one; `opd/reverse_kl` and
    `opd/teacher_logp_mean` with on-policy distillation)."""
    responses = responses.to(topology.device)
    outcomes = algorithm.response_outcomes(responses)  # [N], on the whole batch
    kl_cfg = algorithm.reference_kl
    reference = models.reference if kl_cfg is not None else None
    critic = models.critic.model if algorithm.uses_value_model else None
    prior = models.value_prior  # V_pre: the policy's GAE runs on its blend with the critic

    correction = algorithm.correction if proximal and algorithm.correction.normalises else None
    weight_sums = torch.zeros(len(micros), 2, dtype=torch.float64, device=topology.device)
    scored: list[list[MicroTargets]] = []
    kl_sum = torch.zeros((), dtype=torch.float64, device=topology.device)
    for k, mini in enumerate(micros):
        row = []
        for micro in mini:
            logp_prox = _logprobs(models.policy.model, micro, settings) if proximal else None
            if correction is not None:
                weight_sums[k] += correction.weight_sums(
                    logp_prox, micro.behaviour_logprobs, micro.loss_mask
                ).to(weight_sums.device)
            logp_ref = ref_kl = None
            if reference is not None:
                logp_ref = _logprobs(reference, micro, settings)
                ref_kl = kl_estimate(micro.behaviour_logprobs, logp_ref, kl_cfg.estimator)
                kl_sum += (ref_kl * micro.loss_mask).sum().double()
            old_values = _values(critic, micro) if critic is not None else None
            policy_values = None
            if prior is not None and prior.weight > 0.0 and old_values is not None:
                policy_values = prior.blend(old_values, _values(prior.model, micro))
            advantages, value_targets = algorithm.token_advantages(
                outcomes[micro.sample_index], micro.sampled_mask, ref_kl=ref_kl,
                values=old_values, policy_values=policy_values,
            )  # fmt: skip
            row.append(MicroTargets(advantages, logp_prox, logp_ref, old_values, value_targets))
        scored.append(row)

    normalised = iter(  # over every micro-batch of every rank
        algorithm.normalise_advantages(
            [t.advantages for row in scored for t in row],
            [m.loss_mask for mini in micros for m in mini],
            dist.group.WORLD if topology.world_size > 1 else None,
        )
    )
    means: list[float | None] = [None] * len(micros)
    if correction is not None:  # Σw / count per mini-batch, over every rank
        sums = topology.all_reduce_sum(weight_sums).tolist()
        means = [total / count if count > 0 else 1.0 for total, count in sums]
    opd = algorithm.opd
    opd_sums = torch.zeros(3, dtype=torch.float64, device=topology.device)

    def with_teacher(advantages: Tensor, micro: MicroBatch) -> Tensor:
        if opd is None or micro.is_dummy:
            return advantages
        assert micro.teacher_logprobs is not None  # the batch collector checked every group
        teacher, behaviour = micro.teacher_logprobs, micro.behaviour_logprobs
        opd_sums.add_(opd_metric_sums(teacher, behaviour, micro.loss_mask).to(opd_sums.device))
        return opd.advantages(advantages, teacher, behaviour, micro.loss_mask)

    scored = [
        [
            replace(
                t,
                advantages=_reweighted(algorithm, with_teacher(next(normalised), m), m, responses),
                weight_mean=mean,
            )
            for t, m in zip(row, mini, strict=True)
        ]
        for row, mini, mean in zip(scored, micros, means, strict=True)
    ]

    metrics = {}
    if opd is not None:
        gap, teacher_logp, tokens = topology.all_reduce_sum(opd_sums).tolist()
        metrics["opd/reverse_kl"] = gap / max(tokens, 1.0)
        metrics["opd/teacher_logp_mean"] = teacher_logp / max(tokens, 1.0)
    if reference is not None:
        tokens = sum(m.num_tokens for mini in micros for m in mini)
        totals = topology.all_reduce_sum(torch.stack([kl_sum, kl_sum.new_tensor(tokens)]))
        metrics["actor/ref_kl"] = float(totals[0] / totals[1].clamp(min=1.0))
    return scored, metrics
