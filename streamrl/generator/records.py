"""A generator's stream records: a scored group as a `ScoredGroup`, its rewards shaped.

The raw verifier scores become rule rewards (`algorithm.reward_scale`) plus DAPO's overlong
penalty when the algorithm shapes (over sampled tokens only: `loss_masks` for multi-turn
groups); every record written is counted in the generator's `GeneratorStats`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from storage.records import ScoredGroup
from streamrl.algorithms.shaping import overlong_penalty, scale_rule_reward
from streamrl.config import RunConfig
from streamrl.data import Prompt
from streamrl.envs.runner import Scored
from streamrl.generator.engine import FinishedGroup
from streamrl.generator.rollouts import Rollout

if TYPE_CHECKING:
    from streamrl.generator.loop import GeneratorStats

__all__ = ["GroupRecords"]


class GroupRecords:
    """Builds the stream records of one generator's groups."""

    def __init__(self, config: RunConfig, generator_id: str, stats: GeneratorStats) -> None:
        self.config, self.generator_id, self.stats = config, generator_id, stats

    def single_turn(self, group: FinishedGroup, prompt: Prompt, scores: list[float]) -> ScoredGroup:
        """A single-turn group: the engine's G completions, scored."""
        return self._scored_group(
            prompt,
            np.asarray(group.prompt_token_ids, dtype=np.int32),
            [c.token_ids for c in group.completions],
            [c.logprobs for c in group.completions],
            scores,
            truncated=np.array([c.truncated for c in group.completions]),
            finish_reasons=[c.finish_reason for c in group.completions],
            policy_version=group.policy_version,
            created_at=group.submitted_at,
        )

    def episodes(self, rollout: Rollout, scored: list[Scored]) -> ScoredGroup:
        """A multi-turn group: each episode's transcript and score."""
        arrays = [t.arrays() for t in rollout.transcripts]
        return self._scored_group(
            rollout.prompt,
            np.asarray(rollout.prompt_ids, dtype=np.int32),
            [a[0] for a in arrays],
            [a[1] for a in arrays],
            [s.reward for s in scored],
            truncated=np.array([s.finish_reason == "max_tokens" for s in scored]),
            finish_reasons=[s.finish_reason for s in scored],
            policy_version=rollout.policy_version,
            created_at=rollout.submitted_at,
            loss_masks=[a[2] for a in arrays],
            token_versions=[a[3] for a in arrays],
            turns=np.array([max(t.turns, 1) for t in rollout.transcripts], dtype=np.int32),
            turn_rewards=[
                _turn_rewards(s.turn_rewards, t.turns)
                for s, t in zip(scored, rollout.transcripts, strict=True)
            ],
        )

    def _scored_group(
        self,
        prompt: Prompt,
        prompt_tokens: np.ndarray,
        tokens: list[np.ndarray],
        logprobs: list[np.ndarray],
        scores: list[float],
        *,
        truncated: np.ndarray,
        finish_reasons: list[str],
        policy_version: int,
        created_at: float,
        **multi_turn: Any,
    ) -> ScoredGroup:
        """The stream record of a scored group, its rewards shaped (`algorithm`), counted in
        `stats`."""
        algorithm = self.config.algorithm
        raw = torch.tensor(scores, dtype=torch.float32)
        rewards = scale_rule_reward(raw, algorithm.reward_scale)
        lengths = torch.tensor([len(t) for t in tokens])
        if algorithm.overlong.shaping:
            rewards = rewards + overlong_penalty(
                lengths,
                self.config.generator.max_tokens,
                self.config.overlong_cache_len,
                loss_masks=multi_turn.get("loss_masks"),
            )
        s = self.stats
        s.groups += 1
        s.responses += len(scores)
        s.tokens += int(lengths.sum())
        s.correct += int((raw >= 1.0).sum())
        s.reward_sum += float(rewards.sum())
        s.truncated += int(truncated.sum())
        return ScoredGroup(
            prompt_id=prompt.prompt_id,
            prompt_tokens=prompt_tokens,
            ground_truth=prompt.ground_truth,
            response_tokens=tokens,
            behaviour_logprobs=logprobs,
            rewards=rewards.numpy(),
            raw_scores=raw.numpy(),
            truncated=truncated,
            finish_reasons=finish_reasons,
            policy_version=policy_version,
            generator_id=self.generator_id,
            created_at=created_at,
            finished_at=time.time(),
            **multi_turn,
        )


def _turn_rewards(rewards: tuple[float | None, ...], turns: int) -> np.ndarray:
    """Per-turn rewards as stored: one for each of the `turns` sampled turns when the
    environment gave any (0 for a turn it gave none, such as one cut at its token limit, which
    no step answered), else none."""
    if all(r is None for r in rewards):
        return np.zeros(0, dtype=np.float32)
    given = [0.0 if r is None else r for r in rewards[:turns]]
    return np.array(given + [0.0] * (turns - len(given)), dtype=np.float32)
