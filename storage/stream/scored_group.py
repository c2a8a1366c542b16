"""`ScoredGroup`: one prompt and its G scored responses, the record a generator writes to the
replay stream and the learner trains on (`storage.stream.records` holds the commit log's records).

A response may be multi-turn (an agent with tools or an environment): its tokens interleave
tokens the policy sampled with environment tokens (tool results, user turns, template glue),
told apart by its loss mask. Single-turn groups leave the multi-turn fields None.

Models that score add fields a group without them leaves None: a teacher model's log-probs of
each response token (on-policy distillation) and a reward's terms before weighting (reward
models and judges beside verifiers).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["EPISODE_STATS", "REWARD_TERM_NAME", "TASK_NAME", "InvalidRecordError", "ScoredGroup"]

EPISODE_STATS = ("tool_calls", "tool_errors", "env_seconds", "wait_seconds")
REWARD_TERM_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")
"""A reward term's name (`math`, `judge`): it becomes part of a metric's name."""
TASK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""A group's task (`leg_counting`, `openai_gsm8k`): it becomes part of a metric's name."""


class InvalidRecordError(ValueError):
    """A record breaks one of its invariants; the message names the field."""


@dataclass(frozen=True, eq=False)
class ScoredGroup:
    """One prompt and its G responses, sampled and scored by one generator.

    Invariants (checked by `validate`, on write and on read):
      * G ≥ 1 responses; `response_tokens`, `behaviour_logprobs`, `rewards`, `raw_scores`,
        `truncated` and `finish_reasons` all have G entries, and so do `loss_masks`,
        `token_versions`, `turns`, `turn_rewards` and `teacher_logprobs` when given;
      * len(response_tokens[i]) == len(behaviour_logprobs[i]) == len(loss_masks[i]) ==
        len(token_versions[i]) == len(teacher_logprobs[i]) for every response i;
      * tokens are int32 ≥ 0; log-probs (behaviour and teacher) float32, finite and ≤ 0, and
        exactly 0 at environment tokens (loss mask 0); rewards, raw scores and turn rewards
        finite;
      * loss masks hold only 0 and 1; token versions are ≥ 0;
      * policy_version ≥ 0 (0 = the initial weights) and is the oldest version that sampled a
        token of the group: min of token_versions[i][t] over sampled tokens (mask 1), when the
        group has any;
      * turns ≥ 1; turn_rewards[i] holds turns[i] rewards, or none;
      * teacher_seconds is finite and ≥ 0, and given only with teacher_logprobs;
      * reward_terms names one term or more, each matching `REWARD_TERM_NAME`, each with G
        finite values;
      * task matches `TASK_NAME`; task_level ≥ 0, and given only with a task.

    Fields:
        prompt_id: the dataset's id of the prompt.
        prompt_tokens: `[P] int32` the prompt as the engine saw it (chat template applied).
        ground_truth: the reference answer the reward function compared against.
        response_tokens: G arrays `[L_i] int32`, every token after the prompt (sampled and
            environment tokens alike).
        behaviour_logprobs: G arrays `[L_i] float32`, log π_behav of each sampled token; 0 at
            environment tokens.
        rewards: `[G] float32` reward after shaping (what the learner optimises).
        raw_scores: `[G] float32` the verifier's score before shaping (for metrics).
        truncated: `[G] bool` the response hit max_tokens without finishing.
        finish_reasons: G episode finish reasons ("done", "max_tokens", "max_turns",
            "env_error", "timeout", and "split" for an agent's segment its next request did
            not continue; segments written before environments hold the engine's "stop",
            "length").
        policy_version: the oldest weight version that sampled any token of the group (for a
            single-turn group: the version its responses were sampled with).
        generator_id: which generator produced the group.
        created_at, finished_at: UNIX times when the prompt was submitted and the group scored.

    Multi-turn fields (None = single-turn; read them through the `effective_*` properties,
    which give the single-turn values in place of None):
        loss_masks: G arrays `[L_i] uint8`, 1 at a token the policy sampled, 0 at an
            environment token. Single-turn: all ones.
        token_versions: G arrays `[L_i] int64`, the weight version that produced each token
            (an environment token: the version of the sampled turn before it). Single-turn:
            policy_version everywhere.
        turns: `[G] int32` model turns per response. Single-turn: ones.
        turn_rewards: G arrays `[T_i] float32`, a reward per model turn, or empty where the
            environment gives none. Single-turn: empty.

    Episode statistics, for metrics (None: not recorded, as in segments written before them;
    `RolloutSums` counts them as 0):
        tool_calls, tool_errors: `[G] int32` tool calls per response, and those that failed.
        env_seconds: `[G] float32` time the environment's calls of each episode took.
        wait_seconds: `[G] float32` how long each episode's result waited for the group's
            slowest episode (a straggler's cost).
        tools_offered: the group's environment offered the model tools (False in segments
            written before it was recorded), so tool use is watched while no call is made.

    Scores from models (None: not scored that way, as in segments written before them):
        teacher_logprobs: G arrays `[L_i] float32`, a teacher model's log-prob of each
            response token given the episode's exact token history; 0 at environment tokens.
            None: no teacher scored the group.
        teacher_seconds: wall seconds the teacher took to score the group; None: not timed.
        reward_terms: the reward's terms before weighting, term name → `[G] float32` value per
            response (`{"math": ..., "judge": ...}`). None: the reward had a single term.

    What the prompt was (None: not recorded, as in segments written before it):
        task: the task the prompt's dataset row belongs to (its `data.task_field`, such as a
            reasoning-gym task or verl's data_source), for per-task metrics.
        task_level: the task's difficulty level the prompt was drawn at (a curriculum's).
    """

    prompt_id: str
    prompt_tokens: np.ndarray
    ground_truth: str
    response_tokens: Sequence[np.ndarray]
    behaviour_logprobs: Sequence[np.ndarray]
    rewards: np.ndarray
    raw_scores: np.ndarray
    truncated: np.ndarray
    finish_reasons: Sequence[str]
    policy_version: int
    generator_id: str
    created_at: float
    finished_at: float
    loss_masks: Sequence[np.ndarray] | None = None
    token_versions: Sequence[np.ndarray] | None = None
    turns: np.ndarray | None = None
    turn_rewards: Sequence[np.ndarray] | None = None
    tool_calls: np.ndarray | None = None
    tool_errors: np.ndarray | None = None
    env_seconds: np.ndarray | None = None
    wait_seconds: np.ndarray | None = None
    tools_offered: bool = False
    teacher_logprobs: Sequence[np.ndarray] | None = None
    teacher_seconds: float | None = None
    reward_terms: Mapping[str, np.ndarray] | None = None
    task: str | None = None
    task_level: int | None = None

    @property
    def group_size(self) -> int:
        """G, the number of responses."""
        return len(self.response_tokens)

    @property
    def response_lengths(self) -> np.ndarray:
        """`[G] int64` tokens per response, sampled and environment tokens alike."""
        return np.array([len(t) for t in self.response_tokens], dtype=np.int64)

    @property
    def sampled_lengths(self) -> np.ndarray:
        """`[G] int64` sampled tokens per response (|o_i| in docs/algorithms.md)."""
        if self.loss_masks is None:
            return self.response_lengths
        return np.array([np.count_nonzero(m) for m in self.loss_masks], dtype=np.int64)

    @property
    def num_tokens(self) -> int:
        """Response tokens in the group, sampled and environment tokens alike."""
        return int(self.response_lengths.sum())

    @property
    def is_multi_turn(self) -> bool:
        """Whether a response has an environment token or more than one model turn."""
        return bool((self.effective_turns > 1).any()) or (
            self.loss_masks is not None and any((np.asarray(m) == 0).any() for m in self.loss_masks)
        )

    @property
    def effective_loss_masks(self) -> list[np.ndarray]:
        """`loss_masks`, or all ones (single-turn): G arrays `[L_i] uint8`."""
        if self.loss_masks is None:
            return [np.ones(len(t), np.uint8) for t in self.response_tokens]
        return [np.asarray(m, np.uint8) for m in self.loss_masks]

    @property
    def effective_token_versions(self) -> list[np.ndarray]:
        """`token_versions`, or policy_version everywhere (single-turn): G `[L_i] int64`."""
        if self.token_versions is None:
            return [np.full(len(t), self.policy_version, np.int64) for t in self.response_tokens]
        return [np.asarray(v, np.int64) for v in self.token_versions]

    @property
    def effective_turns(self) -> np.ndarray:
        """`turns`, or ones (single-turn): `[G] int32`."""
        if self.turns is None:
            return np.ones(self.group_size, np.int32)
        return np.asarray(self.turns, np.int32)

    @property
    def effective_turn_rewards(self) -> list[np.ndarray]:
        """`turn_rewards`, or none per response (single-turn): G arrays `[T_i] float32`."""
        if self.turn_rewards is None:
            return [np.zeros(0, np.float32) for _ in range(self.group_size)]
        return [np.asarray(r, np.float32) for r in self.turn_rewards]

    def validate(self) -> ScoredGroup:
        """Raise `InvalidRecordError` naming the first broken invariant; return self."""
        where = f"group {self.prompt_id!r} from {self.generator_id!r}"
        g = len(self.response_tokens)
        if g < 1:
            raise InvalidRecordError(f"{where}: a group needs at least one response")
        sized = {
            "behaviour_logprobs": len(self.behaviour_logprobs),
            "rewards": len(self.rewards),
            "raw_scores": len(self.raw_scores),
            "truncated": len(self.truncated),
            "finish_reasons": len(self.finish_reasons),
        }
        per_response = ("loss_masks", "token_versions", "turns", "turn_rewards", *EPISODE_STATS,
                        "teacher_logprobs")  # fmt: skip
        for name in per_response:
            if getattr(self, name) is not None:
                sized[name] = len(getattr(self, name))
        for name, n in sized.items():
            if n != g:
                raise InvalidRecordError(
                    f"{where}: {name} has {n} entries but there are {g} responses"
                )
        _check_tokens(self.prompt_tokens, f"{where}: prompt_tokens")
        for i, (tokens, logprobs) in enumerate(
            zip(self.response_tokens, self.behaviour_logprobs, strict=True)
        ):
            _check_tokens(tokens, f"{where}: response_tokens[{i}]")
            logprobs = np.asarray(logprobs)
            if logprobs.ndim != 1 or len(logprobs) != len(tokens):
                raise InvalidRecordError(
                    f"{where}: response {i} has {len(tokens)} tokens but "
                    f"{logprobs.size} behaviour log-probs; they must have the same length"
                )
            if logprobs.size and not (np.isfinite(logprobs).all() and (logprobs <= 0).all()):
                raise InvalidRecordError(f"{where}: behaviour_logprobs[{i}] must be finite and ≤ 0")
        for name in ("rewards", "raw_scores"):
            if not np.isfinite(np.asarray(getattr(self, name), dtype=np.float64)).all():
                raise InvalidRecordError(f"{where}: {name} must be finite")
        if self.policy_version < 0:
            raise InvalidRecordError(f"{where}: policy_version must be ≥ 0")
        self._validate_masks_and_versions(where)
        self._validate_turns(where)
        self._validate_episode_stats(where)
        self._validate_teacher(where)
        self._validate_reward_terms(where)
        self._validate_task(where)
        return self

    def _validate_task(self, where: str) -> None:
        if self.task is not None and not (
            isinstance(self.task, str) and TASK_NAME.fullmatch(self.task)
        ):
            raise InvalidRecordError(
                f"{where}: task {self.task!r:.80} must match {TASK_NAME.pattern}"
            )
        if self.task_level is not None:
            if self.task is None:
                raise InvalidRecordError(f"{where}: task_level is given without a task")
            if (
                isinstance(self.task_level, bool)
                or not isinstance(self.task_level, int)
                or (self.task_level < 0)
            ):
                raise InvalidRecordError(f"{where}: task_level must be an int ≥ 0")

    def _validate_episode_stats(self, where: str) -> None:
        for name in EPISODE_STATS:
            values = getattr(self, name)
            if values is None:
                continue
            values = np.asarray(values)
            if values.ndim != 1 or not (np.isfinite(values).all() and (values >= 0).all()):
                raise InvalidRecordError(f"{where}: {name} must be finite and ≥ 0 per response")
        if (self.episode_stat("tool_errors") > self.episode_stat("tool_calls")).any():
            raise InvalidRecordError(f"{where}: tool_errors must be ≤ tool_calls")
        if not isinstance(self.tools_offered, bool | np.bool_):
            raise InvalidRecordError(f"{where}: tools_offered must be a bool")

    def _validate_teacher(self, where: str) -> None:
        """Teacher log-probs, checked after the loss masks (their lengths are the responses')."""
        if self.teacher_seconds is not None:
            if self.teacher_logprobs is None:
                raise InvalidRecordError(
                    f"{where}: teacher_seconds is given but teacher_logprobs is not; only a "
                    "group a teacher scored has a teacher time"
                )
            seconds = self.teacher_seconds
            if not (math.isfinite(seconds) and seconds >= 0):
                raise InvalidRecordError(f"{where}: teacher_seconds must be finite and ≥ 0")
        if self.teacher_logprobs is None:
            return
        masks = self.effective_loss_masks
        for i, (tokens, logprobs) in enumerate(
            zip(self.response_tokens, self.teacher_logprobs, strict=True)
        ):
            logprobs = np.asarray(logprobs)
            if logprobs.ndim != 1 or len(logprobs) != len(tokens):
                raise InvalidRecordError(
                    f"{where}: teacher_logprobs[{i}] has {logprobs.size} entries but response "
                    f"{i} has {len(tokens)} tokens; they must have the same length"
                )
            if logprobs.size and not (np.isfinite(logprobs).all() and (logprobs <= 0).all()):
                raise InvalidRecordError(f"{where}: teacher_logprobs[{i}] must be finite and ≤ 0")
            if (logprobs[masks[i] == 0] != 0).any():
                raise InvalidRecordError(
                    f"{where}: teacher_logprobs[{i}] must be exactly 0 at environment tokens "
                    "(loss mask 0)"
                )

    def _validate_reward_terms(self, where: str) -> None:
        if self.reward_terms is None:
            return
        if not self.reward_terms:
            raise InvalidRecordError(
                f"{where}: reward_terms names no term; leave it None for a single-term reward"
            )
        for name, values in self.reward_terms.items():
            if not isinstance(name, str) or not REWARD_TERM_NAME.fullmatch(name):
                raise InvalidRecordError(
                    f"{where}: reward_terms name {name!r} must be a lower-case letter then up "
                    "to 63 lower-case letters, digits or '_'"
                )
            values = np.asarray(values)
            if values.shape != (self.group_size,):
                raise InvalidRecordError(
                    f"{where}: reward_terms[{name!r}] has shape {values.shape} but there are "
                    f"{self.group_size} responses; give one value per response"
                )
            if not (np.issubdtype(values.dtype, np.number) and np.isfinite(values).all()):
                raise InvalidRecordError(f"{where}: reward_terms[{name!r}] must be finite numbers")

    def _validate_masks_and_versions(self, where: str) -> None:
        """Loss masks and token versions (nothing to check for a single-turn group), checked
        over the group's responses joined (a segment's decode validates every group)."""
        if self.loss_masks is None and self.token_versions is None:
            return
        lengths = [len(t) for t in self.response_tokens]
        ends = np.cumsum(lengths)
        mask = (
            np.ones(ends[-1], np.uint8)
            if self.loss_masks is None
            else _joined(self.loss_masks, lengths, f"{where}: loss_masks")
        )
        version = (
            np.full(ends[-1], self.policy_version, np.int64)
            if self.token_versions is None
            else _joined(self.token_versions, lengths, f"{where}: token_versions")
        )
        if (bad := np.flatnonzero((mask != 0) & (mask != 1))).size:
            raise InvalidRecordError(
                f"{where}: loss_masks[{_response_of(bad[0], ends)}] must hold only 1 (sampled "
                "token) and 0 (environment token)"
            )
        logprobs = np.concatenate([np.asarray(lp) for lp in self.behaviour_logprobs])
        if (bad := np.flatnonzero((mask == 0) & (logprobs != 0))).size:
            raise InvalidRecordError(
                f"{where}: behaviour_logprobs[{_response_of(bad[0], ends)}] must be exactly 0 at "
                "environment tokens (loss mask 0)"
            )
        if (bad := np.flatnonzero(version < 0)).size:
            raise InvalidRecordError(
                f"{where}: token_versions[{_response_of(bad[0], ends)}] must be ≥ 0"
            )
        sampled = version[mask == 1]
        if sampled.size and (oldest := int(sampled.min())) != self.policy_version:
            raise InvalidRecordError(
                f"{where}: policy_version is {self.policy_version} but the oldest version that "
                f"sampled a token (token_versions at loss mask 1) is {oldest}; they must be equal"
            )

    def _validate_turns(self, where: str) -> None:
        if self.turns is not None:
            turns = np.asarray(self.turns)
            if turns.ndim != 1 or not np.issubdtype(turns.dtype, np.integer):
                raise InvalidRecordError(f"{where}: turns must be a 1-d integer array")
            if (turns < 1).any():
                raise InvalidRecordError(f"{where}: turns must be ≥ 1 (model turns per response)")
        if self.turn_rewards is None:
            return
        turns = self.effective_turns.tolist()
        for i, (rewards, n) in enumerate(zip(self.turn_rewards, turns, strict=True)):
            if np.ndim(rewards) != 1 or len(rewards) not in (0, n):
                raise InvalidRecordError(
                    f"{where}: turn_rewards[{i}] holds {np.size(rewards)} rewards but response "
                    f"{i} has {n} turns; give one per turn or none"
                )
        ends = np.cumsum([len(r) for r in self.turn_rewards])
        joined = np.concatenate([np.asarray(r, np.float64) for r in self.turn_rewards])
        if (bad := np.flatnonzero(~np.isfinite(joined))).size:
            raise InvalidRecordError(
                f"{where}: turn_rewards[{_response_of(bad[0], ends)}] must be finite"
            )

    def equals(self, other: ScoredGroup) -> bool:
        """Field-by-field equality (arrays compared by value and dtype-insensitive); a
        multi-turn field left None equals its single-turn values given explicitly; a field of
        scores from models left None differs from any value."""

        def arrays_equal(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> bool:
            return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))

        def optional_equal(a: Any, b: Any, equal: Callable[[Any, Any], bool]) -> bool:
            return a is b is None or (a is not None and b is not None and equal(a, b))

        def terms_equal(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> bool:
            return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)

        return (
            self.prompt_id == other.prompt_id
            and self.ground_truth == other.ground_truth
            and np.array_equal(self.prompt_tokens, other.prompt_tokens)
            and arrays_equal(self.response_tokens, other.response_tokens)
            and arrays_equal(self.behaviour_logprobs, other.behaviour_logprobs)
            and np.array_equal(self.rewards, other.rewards)
            and np.array_equal(self.raw_scores, other.raw_scores)
            and np.array_equal(self.truncated, other.truncated)
            and list(self.finish_reasons) == list(other.finish_reasons)
            and self.policy_version == other.policy_version
            and self.generator_id == other.generator_id
            and self.created_at == other.created_at
            and self.finished_at == other.finished_at
            and arrays_equal(self.effective_loss_masks, other.effective_loss_masks)
            and arrays_equal(self.effective_token_versions, other.effective_token_versions)
            and np.array_equal(self.effective_turns, other.effective_turns)
            and arrays_equal(self.effective_turn_rewards, other.effective_turn_rewards)
            and all(
                np.array_equal(self.episode_stat(name), other.episode_stat(name))
                for name in EPISODE_STATS
            )
            and self.tools_offered == other.tools_offered
            and optional_equal(self.teacher_logprobs, other.teacher_logprobs, arrays_equal)
            and self.teacher_seconds == other.teacher_seconds
            and optional_equal(self.reward_terms, other.reward_terms, terms_equal)
            and self.task == other.task
            and self.task_level == other.task_level
        )

    def episode_stat(self, name: str) -> np.ndarray:
        """Episode statistic `name` (`EPISODE_STATS`), 0 per response where not recorded."""
        values = getattr(self, name)
        return np.zeros(self.group_size) if values is None else np.asarray(values)


def _joined(values: Sequence[np.ndarray], lengths: list[int], what: str) -> np.ndarray:
    """A per-token multi-turn field's G arrays, checked to be 1-d integer (or bool) arrays of
    their responses' lengths, joined into one."""
    if (bad := next((i for i, v in enumerate(values) if np.ndim(v) != 1), None)) is not None:
        raise InvalidRecordError(f"{what}[{bad}] must be a 1-d integer array")
    sizes = [len(v) for v in values]
    if sizes != lengths:
        i = next(i for i, (a, b) in enumerate(zip(sizes, lengths, strict=True)) if a != b)
        raise InvalidRecordError(
            f"{what}[{i}] has {sizes[i]} entries but response {i} has {lengths[i]} tokens; they "
            "must have the same length"
        )
    joined = np.concatenate([np.asarray(v) for v in values])
    if not (np.issubdtype(joined.dtype, np.integer) or joined.dtype == bool):
        raise InvalidRecordError(f"{what} must be integer arrays, got {joined.dtype}")
    return joined


def _response_of(index: int, ends: np.ndarray) -> int:
    """The response holding token `index` of the joined responses (`ends`: cumulative lengths)."""
    return int(np.searchsorted(ends, index, side="right"))


def _check_tokens(tokens: np.ndarray, what: str) -> None:
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise InvalidRecordError(f"{what} must be a 1-d integer array")
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(np.int32).max):
        raise InvalidRecordError(f"{what} holds token ids outside int32 range [0, 2^31)")
