"""Loss assembly: one micro-batch's exact share of its mini-batch's policy and critic losses.

Every term divides by the mini-batch's GLOBAL denominators (`LossDenominators`: tokens or
responses over all its micro-batches on all ranks), so the gradients FSDP sums over ranks are
exactly the full mini-batch's gradient, whatever the token budget or the world size.

Policy loss = the algorithm's policy-gradient term (clipped surrogate or plain policy
gradient) + β·KL to the reference when the KL is a loss term + μ·NLL of correct responses
(VAPO) − c_H·entropy; the critic's loss is its value head's (`algorithm.value_head`: the
clipped value loss on V, or a distributional head's cross-entropy). Every policy micro-batch
also reports the mismatch between behaviour and proximal log-probs
(`streamrl.algorithms.correction.mismatch_metrics`).
"""

from __future__ import annotations

from torch import Tensor, nn

from streamrl.algorithms.config import AlgorithmConfig
from streamrl.algorithms.correction import mismatch_metrics
from streamrl.algorithms.kl import kl_estimate
from streamrl.algorithms.losses import (
    LossDenominators,
    aggregate,
    explained_variance_stats,
    positive_nll_loss,
)
from streamrl.algorithms.masked import masked_mean
from streamrl.algorithms.reductions import StepMetric
from streamrl.learner.forward import token_scores, value_outputs
from streamrl.learner.mini_batches import MicroBatch, MiniBatch
from streamrl.learner.scoring import MicroTargets
from streamrl.learner.step_inputs import StepSettings

__all__ = ["critic_loss", "loss_denominators", "policy_loss"]


def loss_denominators(
    mini: MiniBatch, settings: StepSettings, weight_mean: float | None = None
) -> LossDenominators:
    """The mini-batch's global loss denominators (counted when the batch was cut; the mean
    importance weight by the scoring pass)."""
    return LossDenominators(
        tokens=mini.num_loss_tokens,
        responses=mini.num_responses,
        scored_responses=mini.num_scored_responses,
        positive_tokens=mini.num_positive_tokens,
        max_len=settings.max_response_len,
        weight_mean=weight_mean,
    )


def policy_loss(
    model: nn.Module,
    micro: MicroBatch,
    mini: MiniBatch,
    targets: MicroTargets,
    algorithm: AlgorithmConfig,
    settings: StepSettings,
) -> tuple[Tensor, dict[str, StepMetric]]:
    """This micro-batch's exact share of the mini-batch's policy loss, and its metrics."""
    logp, entropy = token_scores(
        model,
        micro,
        temperature=settings.temperature,
        chunk_tokens=settings.logprob_chunk_tokens,
        entropy_grad=algorithm.entropy_coef > 0,  # a loss term: it needs its own gradient
    )
    mask = micro.loss_mask
    prox = logp.detach() if targets.logp_prox is None else targets.logp_prox
    counts = loss_denominators(mini, settings, targets.weight_mean)
    loss, metrics = algorithm.policy_gradient_loss(
        logp, prox, micro.behaviour_logprobs, targets.advantages, mask, counts
    )
    metrics.update(mismatch_metrics(prox, micro.behaviour_logprobs, mask, micro.fresh))
    if (kl_cfg := algorithm.kl_loss) is not None:
        kl = kl_estimate(logp, targets.logp_ref, kl_cfg.estimator)
        kl_loss = aggregate(kl, mask, "token-mean", num_tokens=counts.tokens)
        loss = loss + kl_cfg.coef * kl_loss
        metrics["actor/kl_loss"] = kl_loss.detach()
    if (nll_coef := algorithm.positive_nll_coef) > 0:
        nll, nll_metrics = positive_nll_loss(
            logp, mask, micro.positive, num_tokens=counts.positive_tokens
        )
        loss = loss + nll_coef * nll
        metrics.update(nll_metrics)
    if algorithm.entropy_coef > 0:
        bonus = aggregate(entropy, mask, "token-mean", num_tokens=counts.tokens)
        loss = loss - algorithm.entropy_coef * bonus
    metrics["actor/entropy"] = masked_mean(entropy.detach(), mask)
    return loss, metrics


def critic_loss(
    critic: nn.Module,
    micro: MicroBatch,
    mini: MiniBatch,
    targets: MicroTargets,
    algorithm: AlgorithmConfig,
) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    """This micro-batch's share of the mini-batch's critic loss, its metrics, and its
    `explained_variance_stats`: explained variance is a ratio, not additive over micro-batches,
    so the step sums the statistics over all of them on all ranks and divides once."""
    outputs, values = value_outputs(critic, micro)
    loss, metrics = algorithm.critic_loss(
        values,
        targets.old_values,
        targets.value_targets,
        micro.loss_mask,
        outputs=outputs,
        num_tokens=mini.num_loss_tokens,
    )
    del metrics["critic/explained_var"]  # this micro-batch's own ratio: from the statistics
    return loss, metrics, explained_variance_stats(values, targets.value_targets, micro.loss_mask)
