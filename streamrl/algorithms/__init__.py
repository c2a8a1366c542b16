"""The algorithm core: pure, vectorised tensor functions for the GRPO family, DAPO and VAPO.

No I/O, no models, no distributed state beyond an optional process group for global
statistics. Each module states its formulas in its docstring and names its paper.

The algorithms' configurations (`config`: one class per algorithm, by family in `outcome`,
`reinforce_pp` and `vapo`, on the interface of `base`) carry what differs per algorithm in a
learner step — advantages, models, loss terms, denominators — built from these functions.

Imports: `streamrl.config.base` and `streamrl.config.merge` only.
"""

from streamrl.algorithms.advantages import (
    broadcast_to_tokens,
    dr_grpo_advantages,
    gae,
    gpg_advantages,
    groups_with_signal,
    grpo_advantages,
    length_adaptive_lambda,
    outcome_token_rewards,
    reinforce_pp_advantages,
    reinforce_pp_returns,
    rloo_advantages,
    vapo_advantages,
)
from streamrl.algorithms.kl import ema_update_, kl_estimate
from streamrl.algorithms.logits import (
    entropy_from_logits,
    token_logprobs,
    token_logprobs_and_entropy,
)
from streamrl.algorithms.losses import (
    LossDenominators,
    aggregate,
    explained_variance,
    explained_variance_from_stats,
    explained_variance_stats,
    positive_nll_loss,
    value_loss,
)
from streamrl.algorithms.masked import (
    group_centred,
    masked_mean,
    masked_sum,
    masked_whiten,
    masked_whiten_jointly,
)
from streamrl.algorithms.policy_losses import pg_loss, policy_loss, ppo_policy_loss
from streamrl.algorithms.shaping import (
    overlong_filter_mask,
    overlong_penalty,
    sampled_lengths,
    scale_rule_reward,
)

__all__ = [
    "LossDenominators",
    "aggregate",
    "broadcast_to_tokens",
    "dr_grpo_advantages",
    "ema_update_",
    "entropy_from_logits",
    "explained_variance",
    "explained_variance_from_stats",
    "explained_variance_stats",
    "gae",
    "gpg_advantages",
    "group_centred",
    "groups_with_signal",
    "grpo_advantages",
    "kl_estimate",
    "length_adaptive_lambda",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "masked_whiten_jointly",
    "outcome_token_rewards",
    "overlong_filter_mask",
    "overlong_penalty",
    "pg_loss",
    "policy_loss",
    "positive_nll_loss",
    "ppo_policy_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_returns",
    "rloo_advantages",
    "sampled_lengths",
    "scale_rule_reward",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "value_loss",
    "vapo_advantages",
]
