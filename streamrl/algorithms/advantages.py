"""Advantage estimators of the GRPO family, REINFORCE++, GPG and (length-adaptive) GAE.

Outcome-reward estimators return one advantage per response, `[N]`; the learner broadcasts it
to every token with `broadcast_to_tokens`. Token-level estimators (REINFORCE++, GAE) return
`[N, T]`. Groups follow the `group_index` layout of `streamrl.algorithms.masked`. Token masks
mark the tokens the policy sampled: a multi-turn response's environment tokens are 0 there
and get no advantage, no reward and no place in a response length (docs/algorithms.md
"Multi-turn rollouts").

Papers: GRPO (Shao et al., DeepSeekMath, 2402.03300), Dr. GRPO (Liu et al., 2503.20783),
RLOO (Ahmadian et al., 2402.14740), REINFORCE++ (Hu, 2501.03262), GPG (Chu et al.,
2504.02546), GAE (Schulman et al., 1506.02438), VAPO (Yue et al., 2504.05118).

Departures, all at degenerate inputs where the papers are silent:

* A group of one response gets advantage 0 under GRPO, Dr. GRPO and RLOO (no baseline exists).
* GPG with every group of zero reward variance (M = B) takes α = 1: all advantages are 0 then.
* VAPO's λ_policy = 1 − 1/(α·l) is negative for l < 1/α (20 tokens at α = 0.05); it is
  clamped at 0 there (one-step TD), since a negative trace weight has no meaning.
"""

from __future__ import annotations

import torch
from torch import Tensor

from streamrl.algorithms.masked import (
    group_centred,
    group_count,
    group_mean,
    group_std,
    masked_whiten_jointly,
)

__all__ = [
    "broadcast_to_tokens",
    "decoupled_gae_advantages",
    "dr_grpo_advantages",
    "gae",
    "gpg_advantages",
    "groups_with_signal",
    "grpo_advantages",
    "length_adaptive_lambda",
    "outcome_token_rewards",
    "reinforce_pp_advantages",
    "reinforce_pp_returns",
    "rloo_advantages",
    "vapo_advantages",
]


def broadcast_to_tokens(advantages: Tensor, mask: Tensor) -> Tensor:
    """Outcome advantage per response `[N]` → per token `[N, T]`, zero where `mask` is 0
    (padding, and environment tokens when `mask` is the sampled-token mask)."""
    return advantages.float().unsqueeze(-1) * mask.float()


def groups_with_signal(scores: Tensor, group_index: Tensor, num_groups: int) -> Tensor:
    """Whether each group's `scores` are not all equal: `[N]` → `[num_groups]` bool.

    Dynamic sampling (DAPO) and GPG's M ask this of the raw verifier scores (correctness):
    with a binary verifier it is 0 < #correct < G. Asked of shaped rewards it would let an
    all-wrong group through on its overlong penalties alone.
    """
    scores = scores.float()
    hi = torch.full((num_groups,), -torch.inf, device=scores.device)
    lo = torch.full((num_groups,), torch.inf, device=scores.device)
    hi = hi.scatter_reduce(0, group_index, scores, reduce="amax")
    lo = lo.scatter_reduce(0, group_index, scores, reduce="amin")
    return hi > lo


def grpo_advantages(
    rewards: Tensor, group_index: Tensor, num_groups: int, eps: float = 1e-6
) -> Tensor:
    """GRPO: A_i = (R_i − mean_g R) / (std_g R + eps), std unbiased (N − 1, as `torch.std`).

    Args:
        rewards: `[N]` outcome rewards (after shaping).
        group_index: `[N]` int64 group ids in `0 .. num_groups − 1`.

    Returns `[N]` float32. A group whose rewards are all equal gets exactly 0, as does a group
    of one response: float32 rounding leaves such a group a std of ~1e-8, not 0, and dividing
    that residue by std + eps would turn it into an advantage of order 1.
    """
    rewards = rewards.float()
    mean = group_mean(rewards, group_index, num_groups)[group_index]
    std = group_std(rewards, group_index, num_groups)[group_index]
    signal = groups_with_signal(rewards, group_index, num_groups)[group_index]
    return torch.where(signal, (rewards - mean) / (std + eps), torch.zeros_like(rewards))


def dr_grpo_advantages(rewards: Tensor, group_index: Tensor, num_groups: int) -> Tensor:
    """Dr. GRPO: A_i = R_i − mean_g R (no division by the group std). `[N]` → `[N]`."""
    return group_centred(rewards, group_index, num_groups)


def rloo_advantages(rewards: Tensor, group_index: Tensor, num_groups: int) -> Tensor:
    """RLOO: A_i = R_i − (Σ_{j≠i} R_j) / (G − 1), the leave-one-out baseline.

    Equals G/(G − 1) · (R_i − mean_g R). A group of one response gets 0. `[N]` → `[N]`.
    """
    rewards = rewards.float()
    sizes = group_count(group_index, num_groups)[group_index]
    sums = torch.zeros(num_groups, device=rewards.device).index_add_(0, group_index, rewards)
    others = (sums[group_index] - rewards) / (sizes - 1.0).clamp(min=1.0)
    return torch.where(sizes > 1, rewards - others, torch.zeros_like(rewards))


def gpg_advantages(
    rewards: Tensor, group_index: Tensor, num_groups: int, scores: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """GPG: A_i = α · (R_i − mean_g R), α = B / (B − M).

    B is the number of groups in the batch and M the number of groups without signal — all
    responses equally correct by their raw verifier `scores` (`[N]`; without shaping the
    rewards themselves, the default); α rescales the gradient so that groups without signal
    do not dilute it.

    Returns `(advantages [N], alpha scalar)`.
    """
    rewards = rewards.float()
    scores = rewards if scores is None else scores
    informative = groups_with_signal(scores, group_index, num_groups).sum().float()
    alpha = torch.where(
        informative > 0, num_groups / informative.clamp(min=1.0), torch.ones_like(informative)
    )
    return alpha * group_centred(rewards, group_index, num_groups), alpha


def outcome_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Place each response's outcome reward on its last valid (sampled) token.

    `rewards: [N]`, `mask: [N, T]` → `[N, T]` float32, zero elsewhere (and on empty rows).
    """
    mask = mask.float()
    positions = torch.arange(1, mask.shape[-1] + 1, device=mask.device, dtype=torch.float32)
    last = (mask * positions).argmax(dim=-1)
    token_rewards = torch.zeros_like(mask)
    has_tokens = mask.sum(-1) > 0
    token_rewards[torch.arange(mask.shape[0], device=mask.device), last] = (
        rewards.float() * has_tokens
    )
    return token_rewards


def reinforce_pp_returns(
    rewards: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0
) -> Tensor:
    """REINFORCE++ returns before whitening: the reward-to-go Σ_{k≥t} r_k (γ = 1) of the token
    rewards r_t = −β·KL_t on every valid token, plus R_i on the last one.

    Environment tokens between sampled ones (mask 0) add no reward: the reward-to-go at a
    sampled token sums the rewards of the sampled tokens from it on.

    Args:
        rewards: `[N]` outcome rewards (minus the group mean for REINFORCE++-baseline).
        mask: `[N, T]` sampled-token mask.
        kl: `[N, T]` per-token KL estimate against the reference (detached), or None.
        kl_coef: β.

    Returns `[N, T]` float32, zero outside the mask.
    """
    mask = mask.float()
    token_rewards = outcome_token_rewards(rewards.float(), mask)
    if kl is not None and kl_coef != 0.0:
        token_rewards = token_rewards - kl_coef * kl.float() * mask
    return token_rewards.flip(-1).cumsum(-1).flip(-1) * mask


def reinforce_pp_advantages(
    rewards: Tensor,
    mask: Tensor,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    *,
    baseline: bool = False,
    group_index: Tensor | None = None,
    num_groups: int | None = None,
    process_group: torch.distributed.ProcessGroup | None = None,
) -> Tensor:
    """REINFORCE++ (and REINFORCE++-baseline) token advantages: `reinforce_pp_returns`
    whitened with mean/std over all valid tokens of the whole global batch (no group
    baseline). The -baseline variant subtracts the group mean reward from R_i first.

    The learner takes the same three steps over its micro-batches (`ReinforcePPConfig`): the
    baseline on the whole batch, the returns per micro-batch, `masked_whiten_jointly` over the
    loss tokens of all of them; for one micro-batch without overlong filtering (loss mask =
    sampled-token mask) its advantages are this function's, bit for bit.

    Args:
        rewards: `[N]` outcome rewards.
        mask: `[N, T]` sampled-token mask (right-padded).
        kl: `[N, T]` per-token KL estimate against the reference (detached), or None.
        kl_coef: β.
        baseline: REINFORCE++-baseline; needs `group_index` and `num_groups`.
        process_group: whiten over the batch of every rank in this group (see `masked_whiten`).

    Returns `[N, T]` float32, zero outside the mask.
    """
    rewards = rewards.float()
    if baseline:
        if group_index is None or num_groups is None:
            raise ValueError("REINFORCE++-baseline needs group_index and num_groups")
        rewards = group_centred(rewards, group_index, num_groups)
    returns = reinforce_pp_returns(rewards, mask, kl, kl_coef)
    return masked_whiten_jointly([returns], [mask], process_group=process_group)[0]


def gae(
    token_rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float,
    lam: float | Tensor,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over right-padded responses.

    δ_t = r_t + γ·V_{t+1} − V_t  (V after the last valid token is 0)
    A_t = Σ_l (γλ)^l δ_{t+l},    return_t = A_t + V_t

    Args:
        token_rewards: `[N, T]` per-token rewards.
        values: `[N, T]` value estimates V_t (detached).
        mask: `[N, T]` one contiguous run of valid tokens per row (single-turn responses:
            a masked token inside the run would cut the trace; VAPO refuses multi-turn).
        lam: λ as a float, or `[N]` per response (length-adaptive GAE).

    Returns `(advantages [N, T], returns [N, T])`, float32, zero outside the mask. The loop
    runs over time steps (a reverse scan); every step is vectorised over the batch.
    """
    mask = mask.float()
    values = values.float() * mask
    token_rewards = token_rewards.float() * mask
    n, t_len = mask.shape
    lam_t = torch.as_tensor(lam, dtype=torch.float32, device=mask.device).expand(n)
    advantages = torch.zeros_like(mask)
    next_value = torch.zeros(n, device=mask.device)
    running = torch.zeros(n, device=mask.device)
    for t in reversed(range(t_len)):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam_t * running) * mask[:, t]
        advantages[:, t] = running
        next_value = values[:, t]
    return advantages, (advantages + values) * mask


def length_adaptive_lambda(lengths: Tensor, alpha: float = 0.05) -> Tensor:
    """VAPO length-adaptive λ_policy = 1 − 1/(α·l), clamped to [0, 1].

    `lengths: [N]` response lengths → `[N]` float32. l = 100 → 0.8, l = 1000 → 0.98 at α = 0.05.
    """
    lengths = lengths.float().clamp(min=1.0)
    return (1.0 - 1.0 / (alpha * lengths)).clamp(0.0, 1.0)


def vapo_advantages(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    *,
    gamma: float = 1.0,
    lam_critic: float = 1.0,
    alpha: float = 0.05,
) -> tuple[Tensor, Tensor]:
    """VAPO decoupled, length-adaptive GAE: `decoupled_gae_advantages` with
    λ_policy = 1 − 1/(α·|o_i|) per response (`length_adaptive_lambda`), |o_i| the row sums of
    `mask`."""
    lam_policy = length_adaptive_lambda(mask.float().sum(-1), alpha)
    return decoupled_gae_advantages(
        rewards, values, mask, gamma=gamma, lam_critic=lam_critic, lam_policy=lam_policy
    )


def decoupled_gae_advantages(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    *,
    gamma: float,
    lam_critic: float,
    lam_policy: Tensor | float,
) -> tuple[Tensor, Tensor]:
    """Decoupled GAE (VAPO, VC-PPO): the outcome reward on the last token; the critic's
    targets with λ_critic (1.0: the unbiased Monte-Carlo return), the policy's advantages with
    λ_policy (`[N]` per response, or one for all), the same γ.

    Args:
        rewards: `[N]` outcome rewards.
        values: `[N, T]` critic values V_t (detached).
        mask: `[N, T]` sampled-token mask.

    Returns `(policy_advantages [N, T], value_targets [N, T])`.
    """
    token_rewards = outcome_token_rewards(rewards, mask)
    policy_advantages, _ = gae(token_rewards, values, mask, gamma, lam_policy)
    _, value_targets = gae(token_rewards, values, mask, gamma, lam_critic)
    return policy_advantages, value_targets
