"""Aggregation, value and auxiliary losses.

The policy losses (PPO's clip, GSPO, CISPO, SAPO, GPG's plain policy gradient) are
`streamrl.algorithms.policy_losses`; each is ℓ = w·ℓ_x with the off-policy correction's
weights and narrowed mask w, m (detached; behaviour mismatch and staleness:
`streamrl.algorithms.correction`; by default w = min(exp(logp_prox − logp_behav), 2)),
reduced by `aggregate`.

Aggregation over the optimiser (mini-)batch:

* token-mean: Σ_{i,t} m·ℓ / (tokens in the whole mini-batch, all micro-batches and ranks)
* seq-mean-token-mean: Σ_i (Σ_t m·ℓ / Σ_t m) / (responses in the whole mini-batch)
* seq-mean-token-sum-norm: Σ_{i,t} m·ℓ / (responses in the whole mini-batch · L_max)

Pass the global counts (`num_tokens`, `num_seqs`) and every micro-batch loss is an exact share
of the full-batch loss: summing the micro-batch losses (and the ranks' gradients) reproduces
it. Without them the counts of the tensors at hand are used.

Denominator convention for rejections (a rejection band, the veto, IcePop): rejected tokens
contribute 0 to the numerator but still count in the denominator (they are rejected samples
of the batch, known only after the forward pass, while the denominator must be fixed before
it).

Every mask here is the loss mask: the tokens the policy sampled (docs/algorithms.md "Multi-turn
rollouts": environment tokens are 0 in it), less filtered ones. Whatever values the other
tensors hold where it is 0, they change neither a loss, its gradient, a denominator nor a metric.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from streamrl.algorithms.correction_config import RolloutCorrection
from streamrl.algorithms.masked import masked_mean, zero_outside
from streamrl.algorithms.reductions import StepMetric

__all__ = [
    "Aggregation",
    "LossDenominators",
    "aggregate",
    "distributional_value",
    "distributional_value_loss",
    "explained_variance",
    "explained_variance_from_stats",
    "explained_variance_stats",
    "positive_nll_loss",
    "two_hot",
    "value_atoms",
    "value_loss",
]

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
Metrics = dict[str, StepMetric]
DEFAULT_CORRECTION = RolloutCorrection()
"""Token-level truncated importance sampling at C = 2 (every preset's correction)."""


@dataclass(frozen=True)
class LossDenominators:
    """The global denominators of one optimiser mini-batch: counted over all its micro-batches
    on all ranks, fixed before any forward pass (so every micro-batch's loss is its exact share).

    tokens            loss tokens (token-mean; the KL and entropy terms)
    responses         responses (seq-mean-token-sum-norm)
    scored_responses  responses with at least one loss token (seq-mean-token-mean)
    positive_tokens   loss tokens of correct responses (VAPO's positive-example loss)
    max_len           L_max, the generator's max_tokens (seq-mean-token-sum-norm)
    weight_mean       the mean truncated importance weight over the kept loss tokens, when
                      the correction normalises its weights (`RolloutCorrection.is_normalize`)
    """

    tokens: int
    responses: int
    scored_responses: int
    positive_tokens: int
    max_len: int
    weight_mean: float | None = None

    def sequences(self, aggregation: Aggregation) -> int:
        """The sequence denominator of `aggregation`: seq-mean-token-mean averages over the
        responses that have a loss token, seq-mean-token-sum-norm over all of them."""
        return self.scored_responses if aggregation == "seq-mean-token-mean" else self.responses


def aggregate(
    loss: Tensor,
    mask: Tensor,
    mode: Aggregation,
    *,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    max_len: int | None = None,
) -> Tensor:
    """Reduce a per-token loss `[N, T]` to a scalar.

    Args:
        loss: `[N, T]` per-token loss ℓ.
        mask: `[N, T]` tokens that count.
        mode: see the module docstring.
        num_tokens: token-mean denominator — valid tokens in the whole optimiser mini-batch,
            all micro-batches and ranks. Default: `mask.sum()`.
        num_seqs: sequence denominator — responses in the whole mini-batch. Default: rows of
            `mask` with at least one valid token (seq-mean-token-mean) or all rows (sum-norm).
        max_len: L_max for seq-mean-token-sum-norm (the generator's max_tokens); default T.
    """
    mask = mask.float()
    weighted = zero_outside(loss, mask)
    if mode == "token-mean":
        denom = mask.sum() if num_tokens is None else num_tokens
        return weighted.sum() / torch.as_tensor(denom, dtype=torch.float32).clamp(min=1.0)
    if mode == "seq-mean-token-mean":
        tokens_per_seq = mask.sum(-1)
        seq_means = weighted.sum(-1) / tokens_per_seq.clamp(min=1.0)
        denom = (tokens_per_seq > 0).sum() if num_seqs is None else num_seqs
        return seq_means.sum() / torch.as_tensor(denom, dtype=torch.float32).clamp(min=1.0)
    if mode == "seq-mean-token-sum-norm":
        denom_seqs = mask.shape[0] if num_seqs is None else num_seqs
        length = mask.shape[-1] if max_len is None else max_len
        denom = torch.as_tensor(denom_seqs, dtype=torch.float32).clamp(min=1.0) * length
        return weighted.sum() / denom
    raise ValueError(
        f"unknown aggregation {mode!r}; use token-mean, seq-mean-token-mean or "
        "seq-mean-token-sum-norm"
    )


def value_loss(
    values: Tensor,
    old_values: Tensor,
    targets: Tensor,
    mask: Tensor,
    *,
    clip: float = 0.5,
    num_tokens: float | Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """Clipped value loss (PPO / VAPO), token-mean:

        ½ · max((V − V_tgt)², (V_old + clip(V − V_old, −ε_v, ε_v) − V_tgt)²)

    Args:
        values: `[N, T]` current critic values, with grad.
        old_values: `[N, T]` critic values when the batch was scored (no grad).
        targets: `[N, T]` value targets V_tgt.
        clip: ε_v.
        num_tokens: tokens in the whole mini-batch (all micro-batches and ranks).

    Returns `(loss, metrics)`: critic/vf_loss, critic/vf_clip_frac, critic/explained_var.
    """
    values = values.float()
    old_values = old_values.detach().float()
    targets = targets.detach().float()
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    plain = (values - targets) ** 2
    clipped = (clipped_values - targets) ** 2
    per_token = 0.5 * torch.maximum(plain, clipped)
    loss = aggregate(per_token, mask, "token-mean", num_tokens=num_tokens)
    metrics = {
        "critic/vf_loss": loss.detach(),
        "critic/vf_clip_frac": masked_mean((clipped > plain).float(), mask).detach(),
        "critic/explained_var": explained_variance(values.detach(), targets, mask),
    }
    return loss, metrics


def value_atoms(
    v_min: float, v_max: float, atoms: int, device: torch.device | None = None
) -> Tensor:
    """The distributional critic's support z_1..z_N, evenly spaced on [v_min, v_max]: `[N]`
    float32 (z_1 = v_min, z_N = v_max, spacing Δ = (v_max − v_min)/(N − 1))."""
    return torch.linspace(v_min, v_max, atoms, dtype=torch.float32, device=device)


def distributional_value(logits: Tensor, v_min: float, v_max: float) -> Tensor:
    """V = Σ_i softmax(logits)_i · z_i over the atoms of `value_atoms`: `logits [..., N]` →
    `[...]` float32."""
    atoms = value_atoms(v_min, v_max, logits.shape[-1], logits.device)
    return (torch.softmax(logits.float(), dim=-1) * atoms).sum(-1)


def two_hot(targets: Tensor, v_min: float, v_max: float, atoms: int) -> Tensor:
    """The two-hot projection of scalar targets onto the atoms: `targets [...]` → `[..., N]`
    float32, each row non-negative and summing to 1.

    A target is first clipped to [v_min, v_max]. Between z_j and z_{j+1} it puts
    (z_{j+1} − t)/Δ on atom j and (t − z_j)/Δ on atom j + 1, so Σ_i p_i·z_i = t; on an atom
    (up to float rounding) all its mass is there."""
    clipped = targets.detach().float().clamp(v_min, v_max)
    position = ((clipped - v_min) * ((atoms - 1) / (v_max - v_min))).clamp(0.0, atoms - 1)
    lower = position.floor().clamp(max=atoms - 2)  # t = v_max: all mass on the upper atom
    upper_mass = position - lower
    index = lower.long().unsqueeze(-1)
    projection = torch.zeros(*clipped.shape, atoms, dtype=torch.float32, device=targets.device)
    projection.scatter_(-1, index, (1.0 - upper_mass).unsqueeze(-1))
    projection.scatter_add_(-1, index + 1, upper_mass.unsqueeze(-1))
    return projection


def distributional_value_loss(
    logits: Tensor,
    targets: Tensor,
    mask: Tensor,
    *,
    v_min: float,
    v_max: float,
    num_tokens: float | Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """The distributional critic's loss (the framework guide's eq 22), token-mean:

        ℓ = −Σ_i two_hot(clip(V_tgt, v_min, v_max))_i · log softmax(logits)_i

    Args:
        logits: `[N, T, K]` the head's logits over K atoms evenly spaced on [v_min, v_max],
            with grad.
        targets: `[N, T]` value targets V_tgt (no grad).
        mask: `[N, T]` loss mask.
        num_tokens: the denominator: loss tokens in the whole mini-batch (all micro-batches
            and ranks), so micro-batch losses sum to the mini-batch's. Default: `mask.sum()`.

    Returns `(loss, metrics)`: critic/vf_loss, critic/explained_var (of V = Σ p·z, see
    `distributional_value`) and critic/target_clip_frac (loss tokens whose target lay outside
    [v_min, v_max] and was clipped: a support too narrow for the returns).
    """
    logits = logits.float()
    targets = targets.detach().float()
    projection = two_hot(targets, v_min, v_max, logits.shape[-1])
    per_token = -(projection * torch.log_softmax(logits, dim=-1)).sum(-1)
    loss = aggregate(per_token, mask, "token-mean", num_tokens=num_tokens)
    values = distributional_value(logits.detach(), v_min, v_max)
    outside = (targets < v_min) | (targets > v_max)
    metrics = {
        "critic/vf_loss": loss.detach(),
        "critic/target_clip_frac": masked_mean(outside.float(), mask).detach(),
        "critic/explained_var": explained_variance(values, targets, mask),
    }
    return loss, metrics


def positive_nll_loss(
    logp: Tensor,
    mask: Tensor,
    positive: Tensor,
    *,
    num_tokens: float | Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """VAPO positive-example LM loss: token-mean of −logp_θ over responses with a correct answer.

    Args:
        logp: `[N, T]` log π_θ of the sampled tokens, with grad.
        mask: `[N, T]` loss mask (sampled tokens).
        positive: `[N]` bool, the response's answer is correct.
        num_tokens: valid tokens of *positive* responses in the whole mini-batch.

    Returns `(loss, {"actor/nll_loss": ...})`; 0 when no response is positive.
    """
    positive_mask = mask.float() * positive.float().unsqueeze(-1)
    loss = aggregate(-logp.float(), positive_mask, "token-mean", num_tokens=num_tokens)
    return loss, {"actor/nll_loss": loss.detach()}


def explained_variance(values: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """1 − Var(V_tgt − V) / Var(V_tgt) over masked tokens (detached float32 scalar).

    1 is a perfect critic, 0 no better than a constant, negative worse. Returns 0 when the
    targets have no variance (the ratio is undefined there). Computed as
    `explained_variance_from_stats(explained_variance_stats(...))`: over several micro-batches
    or ranks, sum their statistics first (a mean of per-micro-batch ratios is not the ratio).
    """
    stats = explained_variance_stats(values, targets, mask)
    return torch.tensor(
        explained_variance_from_stats(stats), dtype=torch.float32, device=values.device
    )


def explained_variance_stats(values: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """The additive statistics of explained variance over masked tokens, `[5]` float64:
    [n, Σt, Σt², Σr, Σr²] with t = V_tgt and r = V_tgt − V (detached). `values, targets,
    mask: [N, T]`. Sums over micro-batches and ranks are the statistics of their union."""
    mask = mask.double()
    target, residual = targets.double(), (targets - values).double()
    return torch.stack(
        [
            mask.sum(),
            (target * mask).sum(),
            (target * target * mask).sum(),
            (residual * mask).sum(),
            (residual * residual * mask).sum(),
        ]
    ).detach()


def explained_variance_from_stats(stats: Tensor) -> float:
    """1 − Var(r) / Var(t) from summed `explained_variance_stats` (population variances);
    0 for no tokens or targets without variance."""
    n, st, st2, sr, sr2 = stats.tolist()
    if n == 0:
        return 0.0
    var_t, var_r = st2 / n - (st / n) ** 2, sr2 / n - (sr / n) ** 2
    return 1.0 - var_r / var_t if var_t > 1e-12 else 0.0
