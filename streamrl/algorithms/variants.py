"""The framework guide's outcome-advantage variants (equation numbers are the guide's;
docs/algorithms.md "Framework-guide variants"), each `[N]` → `[N]` float32 over groups in the
`group_index` layout of `streamrl.algorithms.masked` (any group sizes, G = 1 included):

* weighted baseline (eqs 39, 52): A_i = R_i − Σ_j q_j R_j / Σ_j q_j over the group, q uniform
  (= Dr. GRPO), 1/√|o_j| (`inv_sqrt_len`) or exp(mean_t logp_behav_{j,t}) (`confidence`, the
  response's geometric-mean token probability); divided by (std_g R + ε) where the algorithm's
  advantage normalises by the std (GRPO, DAPO), 0 for a group whose rewards are all equal;
* rank-based (eq 40): A_i = (rank(R_i) − (G + 1)/2) / (G/2), ranks 1..G ascending, ties
  sharing the mean of their ranks; a group of one gets 0;
* hierarchical (eq 51): A_i = α·(R_i − mean_g R) + (1 − α)·(R_i − mean_B R), mean_B over the
  responses of the response's optimiser batch;
* temporal groups (Alg. 5): R_i less the mean over its group's current rewards pooled with the
  prompt's earlier rewards (`streamrl.learner.reward_history` keeps them), over (the pooled
  std + ε) where the algorithm normalises; only current responses get an advantage;
* sequence-level reweighting (eq 30): each response's loss times (|o_i| / L_median)^(−α_w),
  L_median the median length of the loss-bearing responses of its optimiser batch.

Departures where the guide is silent: a response without sampled tokens takes |o| = 1 in
inv_sqrt_len (its weight matters only to its group's baseline) and weight 1 in eq 30 (it has
no loss tokens); L_median of an even count is the mean of the middle two.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from streamrl.algorithms.advantages import groups_with_signal
from streamrl.algorithms.masked import group_count, group_mean, group_std

__all__ = [
    "BaselineWeights",
    "hierarchical_advantages",
    "rank_advantages",
    "sequence_length_weights",
    "temporal_advantages",
    "weighted_baseline_advantages",
]

BaselineWeights = Literal["uniform", "inv_sqrt_len", "confidence"]


def weighted_baseline_advantages(
    rewards: Tensor,
    group_index: Tensor,
    num_groups: int,
    *,
    weights: BaselineWeights,
    lengths: Tensor,
    mean_logp_behav: Tensor,
    std_eps: float | None = None,
) -> Tensor:
    """R_i less the q-weighted group mean, over (std_g R + `std_eps`) when `std_eps` is given.

    `lengths`: `[N]` sampled tokens per response; `mean_logp_behav`: `[N]` the mean behaviour
    log-prob over them."""
    rewards = rewards.float()
    if weights == "uniform":
        q = torch.ones_like(rewards)
    elif weights == "inv_sqrt_len":
        q = lengths.float().clamp(min=1.0).rsqrt()
    elif weights == "confidence":
        q = torch.exp(mean_logp_behav.float())
    else:
        raise ValueError(f"unknown baseline weights {weights!r}; use uniform, inv_sqrt_len or "
                         "confidence")  # fmt: skip
    zeros = torch.zeros(num_groups, device=rewards.device)
    weighted = zeros.index_add(0, group_index, q * rewards)
    total = zeros.index_add(0, group_index, q).clamp(min=torch.finfo(torch.float32).tiny)
    centred = rewards - (weighted / total)[group_index]
    if std_eps is None:
        return centred
    std = group_std(rewards, group_index, num_groups)[group_index]
    signal = groups_with_signal(rewards, group_index, num_groups)[group_index]
    return torch.where(signal, centred / (std + std_eps), torch.zeros_like(rewards))


def rank_advantages(rewards: Tensor, group_index: Tensor, num_groups: int) -> Tensor:
    """(rank − (G + 1)/2) / (G/2) with average ranks for ties (O(N log N): two stable sorts,
    then the runs of equal (group, reward))."""
    rewards = rewards.float()
    n = rewards.numel()
    if n == 0:
        return rewards
    order = torch.argsort(rewards, stable=True)
    order = order[torch.argsort(group_index[order], stable=True)]  # by group, then reward
    g, r = group_index[order], rewards[order]
    new_group = torch.ones(n, dtype=torch.bool, device=rewards.device)
    new_group[1:] = g[1:] != g[:-1]
    new_run = new_group.clone()
    new_run[1:] |= r[1:] != r[:-1]
    position = torch.arange(n, device=rewards.device)
    group_start = torch.cummax(torch.where(new_group, position, 0), 0).values
    run_id = new_run.long().cumsum(0) - 1
    run_start = position[new_run]
    run_length = torch.diff(torch.cat([run_start, run_start.new_tensor([n])])).float()
    first_rank = (run_start - group_start[run_start] + 1).float()  # within the group, 1-based
    mean_rank = first_rank + (run_length - 1.0) / 2.0
    ranks = torch.empty_like(rewards)
    ranks[order] = mean_rank[run_id]
    size = group_count(group_index, num_groups)[group_index]
    return (ranks - (size + 1.0) / 2.0) / (size / 2.0)


def hierarchical_advantages(
    rewards: Tensor, group_index: Tensor, num_groups: int, optimiser_batch: Tensor, alpha: float
) -> Tensor:
    """α·(R − mean_g R) + (1 − α)·(R − mean_B R); `optimiser_batch: [N] int64` (dense ids)."""
    rewards = rewards.float()
    group = group_mean(rewards, group_index, num_groups)[group_index]
    batches = int(optimiser_batch.max()) + 1 if optimiser_batch.numel() else 0
    batch = group_mean(rewards, optimiser_batch, batches)[optimiser_batch]
    return alpha * (rewards - group) + (1.0 - alpha) * (rewards - batch)


def temporal_advantages(
    rewards: Tensor,
    group_index: Tensor,
    num_groups: int,
    past_rewards: Tensor,
    past_group: Tensor,
    std_eps: float | None = None,
) -> Tensor:
    """R_i − mean over the pooled set {the group's rewards} ∪ {its prompt's past rewards}, over
    (the pooled set's unbiased std + `std_eps`) when `std_eps` is given (0 for a pooled set of
    equal rewards, as GRPO's). `past_rewards: [M]` float32, `past_group: [M]` int64: each past
    reward's group in this batch. Without past rewards: the paper's group advantage, bitwise."""
    rewards = rewards.float()
    pooled = torch.cat([rewards, past_rewards.float().to(rewards.device)])
    index = torch.cat([group_index, past_group.to(group_index.device)])
    centred = rewards - group_mean(pooled, index, num_groups)[group_index]
    if std_eps is None:
        return centred
    std = group_std(pooled, index, num_groups)[group_index]
    signal = groups_with_signal(pooled, index, num_groups)[group_index]
    return torch.where(signal, centred / (std + std_eps), torch.zeros_like(rewards))


def sequence_length_weights(lengths: Tensor, median_length: Tensor, alpha: float) -> Tensor:
    """(|o_i| / L_median)^(−α) per response, 1 where |o_i| = 0 (no loss tokens).
    `lengths`, `median_length`: `[n]` (each response's optimiser-batch median)."""
    lengths = lengths.float()
    ratio = lengths / median_length.float().clamp(min=1.0)
    return torch.where(lengths > 0, ratio.clamp(min=1e-12).pow(-alpha), torch.ones_like(ratio))
