"""A generator's stream records: a finished rollout as a `ScoredGroup`, its rewards shaped.

The raw verifier scores become rule rewards (`algorithm.reward_scale`), weighed with the
reward's model terms when it has any (R = Σ_k c_k·R_k, each R_k stored), shaped by length when
the algorithm asks: DAPO's overlong penalty (`algorithm.overlong.shaping`) or the framework
guide's adaptive length penalty (`algorithm.length_penalty`), both over sampled tokens only
(`loss_masks` for multi-turn groups). The raw scores are stored unshaped: dynamic sampling
decides on correctness. Every record written is counted in the generator's `GeneratorStats`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from storage.stream.records import ScoredGroup
from streamrl.algorithms.shaping import (
    adaptive_length_penalty,
    overlong_penalty,
    scale_rule_reward,
)
from streamrl.config.run import RunConfig
from streamrl.envs.runner import Scored
from streamrl.generator.rollouts import Rollout
from streamrl.scorers.teacher import TeacherScores
from streamrl.scorers.terms import TermScores

__all__ = ["GeneratorStats", "GroupRecords"]


@dataclass
class GeneratorStats:
    """Counters since the loop started (the throughput log line reports their rates).

    `groups`, `responses`, ... count what was written to the stream; `reward_errors` and
    `reward_timeouts` count failed reward calls, `dropped_groups` the groups they kept out of
    the stream (`generator.reward.on_error=drop_group`). `corrupt_weight_versions` counts
    published versions that failed verification (skipped for good), `weight_update_failures`
    versions that vanished (removed by retention) while being read. `paused_s` is how long flow
    control refused new prompts (`streamrl.generator.flow_control`). `weights_handed_off`: the
    updates taken from the learner's memory (`streamrl.placement.handoff`), not from storage."""

    groups: int = 0
    responses: int = 0
    tokens: int = 0
    correct: int = 0
    reward_sum: float = 0.0
    truncated: int = 0
    segments: int = 0
    weight_updates: int = 0
    weight_update_s: float = 0.0
    weights_handed_off: int = 0  # of the updates, those taken from the learner's memory
    weight_update_failures: int = 0
    corrupt_weight_versions: int = 0
    reward_errors: int = 0
    reward_timeouts: int = 0
    dropped_groups: int = 0
    paused_s: float = 0.0


class GroupRecords:
    """Builds the stream records of one generator's groups."""

    def __init__(self, config: RunConfig, generator_id: str, stats: GeneratorStats) -> None:
        self.config, self.generator_id, self.stats = config, generator_id, stats

    def group(
        self,
        rollout: Rollout,
        scored: list[Scored],
        teacher: TeacherScores | None = None,
        terms: dict[str, TermScores] | None = None,
    ) -> ScoredGroup:
        """A finished group as its record: each episode's transcript, score and statistics,
        rewards combined from their terms (`terms`: the model terms' scores, when the reward
        has any) and shaped (`algorithm`), the teacher's log-probs when it has them, counted in
        `stats`. The multi-turn fields are left None where they hold their single-turn values
        (one turn, no environment token, one weight version, no turn reward), so a single-turn
        group is stored as one."""
        arrays = [t.arrays() for t in rollout.transcripts]
        tokens, masks, versions = (
            [a[0] for a in arrays],
            [a[2] for a in arrays],
            [a[3] for a in arrays],
        )
        loss_masks = None if all(m.all() for m in masks) else masks
        version = rollout.policy_version
        turns = np.array([max(t.turns, 1) for t in rollout.transcripts], dtype=np.int32)
        turn_rewards = [
            _turn_rewards(s.turn_rewards, t.turns)
            for s, t in zip(scored, rollout.transcripts, strict=True)
        ]
        truncated = np.array([s.finish_reason == "max_tokens" for s in scored])

        algorithm = self.config.algorithm
        rule = torch.tensor([s.reward for s in scored], dtype=torch.float32)
        rewards, raw, reward_terms = self._combined(rule, terms)
        if named := _agent_terms(scored):  # stored beside the reward, never weighted into it
            reward_terms = reward_terms or {self.config.generator.reward.rule_term: rewards.numpy()}
            reward_terms = {**reward_terms, **named}
        lengths = torch.tensor([len(t) for t in tokens])
        if algorithm.overlong.shaping:
            rewards = rewards + overlong_penalty(
                lengths,
                self.config.generator.max_tokens,
                self.config.overlong_cache_len,
                loss_masks=loss_masks,
            )
        penalty = algorithm.length_penalty
        if penalty is not None:
            rewards = rewards + adaptive_length_penalty(
                rewards,
                lengths,
                target=self.config.length_penalty_target,
                a=penalty.a,
                b=penalty.b,
                r_th=penalty.r_th,
                lambda_base=penalty.lambda_base,
                gamma=penalty.gamma,
                loss_masks=loss_masks,
            )
        s = self.stats
        s.groups += 1
        s.responses += len(scored)
        s.tokens += int(lengths.sum())
        s.correct += int((raw >= 1.0).sum())
        s.reward_sum += float(rewards.sum())
        s.truncated += int(truncated.sum())
        episodes = rollout.episodes
        return ScoredGroup(
            prompt_id=rollout.prompt.prompt_id,
            prompt_tokens=np.asarray(rollout.prompt_ids, dtype=np.int32),
            ground_truth=rollout.prompt.ground_truth,
            response_tokens=tokens,
            behaviour_logprobs=[a[1] for a in arrays],
            rewards=rewards.numpy(),
            raw_scores=raw.numpy(),
            truncated=truncated,
            finish_reasons=[s.finish_reason for s in scored],
            policy_version=version,
            generator_id=self.generator_id,
            created_at=rollout.submitted_at,
            finished_at=time.time(),
            loss_masks=loss_masks,
            token_versions=None if all((v == version).all() for v in versions) else versions,
            turns=None if (turns == 1).all() else turns,
            turn_rewards=turn_rewards if any(len(r) for r in turn_rewards) else None,
            tool_calls=np.array([e.tool_calls for e in episodes], dtype=np.int32),
            tool_errors=np.array([e.tool_errors for e in episodes], dtype=np.int32),
            env_seconds=np.array([e.env_s for e in episodes], dtype=np.float32),
            wait_seconds=rollout.wait_seconds(),
            tools_offered=any(e.tools_offered for e in episodes),
            teacher_logprobs=teacher.logprobs if teacher is not None else None,
            teacher_seconds=teacher.seconds if teacher is not None else None,
            reward_terms=reward_terms,
            task=rollout.prompt.task,
            task_level=rollout.prompt.task_level,
        )

    def _combined(
        self, rule: torch.Tensor, terms: dict[str, TermScores] | None
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, np.ndarray] | None]:
        """(R = Σ_k c_k·R_k before shaping, the raw score of the correctness term, each term's
        R_k to store — None for the rule alone). The rule term's R is the rule reward
        (`algorithm.reward_scale`) of its raw score; its raw score is correctness unless
        `generator.reward.correctness` names a model term."""
        reward = self.config.generator.reward
        rule_reward = scale_rule_reward(rule, self.config.algorithm.reward_scale)
        if not terms:
            return rule_reward, rule, None
        values = {reward.rule_term: rule_reward}
        values |= {name: torch.tensor(t.values, dtype=torch.float32) for name, t in terms.items()}
        total = reward.weight * rule_reward
        for name, term in reward.models.items():
            total = total + term.weight * values[name]
        correct = reward.correctness_term
        raw = rule if correct == reward.rule_term else values[correct]
        return total, raw, {name: v.numpy() for name, v in values.items()}


def _agent_terms(scored: list[Scored]) -> dict[str, np.ndarray]:
    """The named parts of the episodes' rewards (a verifiers rubric's functions), term name →
    `[G]` values; 0 for an episode that has none (it failed)."""
    names = sorted({name for s in scored for name in (s.terms or {})})
    return {
        name: np.array([(s.terms or {}).get(name, 0.0) for s in scored], dtype=np.float32)
        for name in names
    }


def _turn_rewards(rewards: tuple[float | None, ...], turns: int) -> np.ndarray:
    """Per-turn rewards as stored: one for each of the `turns` sampled turns when the
    environment gave any (0 for a turn it gave none, such as one cut at its token limit, which
    no step answered), else none."""
    if all(r is None for r in rewards):
        return np.zeros(0, dtype=np.float32)
    given = [0.0 if r is None else r for r in rewards[:turns]]
    return np.array(given + [0.0] * (turns - len(given)), dtype=np.float32)
