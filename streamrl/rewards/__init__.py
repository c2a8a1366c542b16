"""Verifiable rewards: which function scores a response, and running it safely.

A reward function scores one response against its ground truth:

    def reward(response: str, ground_truth: str, *, prompt: str | None = None) -> float

returning a score in [0, 1] (1 = correct) or a bool. `generator.reward.fn` names one:
a registered name (`math`, `format`, `math_format`; see `streamrl.rewards.math`) or a user
function by import path `package.module:function`, found by `resolve_reward`.

Generators never call it directly: `RewardScorer` runs it in worker processes under a time
limit, scoring a failing, hanging or misbehaving call 0.0, marking it failed in the batch's
`Scores` and counting it (`generator.reward.on_error` decides whether the generator drops
such a group or trains on it). Scores are raw; `streamrl.algorithms.shaping.scale_rule_reward`
turns them into the rule reward (±1 or 1/0).
"""

from streamrl.rewards.math import format_reward, math_format_reward, math_reward
from streamrl.rewards.registry import (
    REWARD_FUNCTIONS,
    RewardFn,
    RewardResolutionError,
    registered_rewards,
    resolve_reward,
)
from streamrl.rewards.scoring import Failure, RewardScorer, Scores, ScoringStats
from streamrl.rewards.worker import RewardValueError, check_score

__all__ = [
    "REWARD_FUNCTIONS",
    "Failure",
    "RewardFn",
    "RewardResolutionError",
    "RewardScorer",
    "RewardValueError",
    "Scores",
    "ScoringStats",
    "check_score",
    "format_reward",
    "math_format_reward",
    "math_reward",
    "registered_rewards",
    "resolve_reward",
]
