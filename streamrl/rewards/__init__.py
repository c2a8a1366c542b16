"""Verifiable rewards: which function scores a response, and running it safely.

A reward function scores one response against its ground truth:

    def reward(response: str, ground_truth: str, *, prompt: str | None = None) -> float

returning a score in [0, 1] (1 = correct) or a bool. `generator.reward.fn` names one:
a registered name (`math`, `format`, `math_format`; see `streamrl.rewards.math`) or a user
function by import path `package.module:function`, found by `resolve_reward`.

Generators never call it, nor import a user's module: `RewardScorer` does both in worker
processes with a time limit per call and on loading, a memory limit and no credentials in
their environment, scoring a failing, hanging or misbehaving call 0.0, marking it failed in
the batch's `Scores` and counting it (`generator.reward.on_error` decides whether the
generator drops such a group or trains on it). Scores are raw;
`streamrl.algorithms.shaping.scale_rule_reward` turns them into the rule reward (±1 or 1/0).

Imports: `streamrl.config.base`, `streamrl.isolation`.
"""

from streamrl.rewards.math import format_reward, math_format_reward, math_reward
from streamrl.rewards.registry import (
    REWARD_FUNCTIONS,
    RewardFn,
    RewardResolutionError,
    check_reward_name,
    registered_rewards,
    resolve_reward,
)
from streamrl.rewards.scoring import (
    Failure,
    RewardLoadError,
    RewardScorer,
    Scores,
    ScoringStats,
)
from streamrl.rewards.worker import RewardValueError, check_score

__all__ = [
    "REWARD_FUNCTIONS",
    "Failure",
    "RewardFn",
    "RewardLoadError",
    "RewardResolutionError",
    "RewardScorer",
    "RewardValueError",
    "Scores",
    "ScoringStats",
    "check_reward_name",
    "check_score",
    "format_reward",
    "math_format_reward",
    "math_reward",
    "registered_rewards",
    "resolve_reward",
]
