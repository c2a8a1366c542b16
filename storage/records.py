"""The replay stream's wire records: `ScoredGroup` (one prompt and its G scored responses),
`CommitRecord` (one entry of the commit log) and `Cursor` (a reader's position).

These are the boundary between generators and the learner; both sides validate them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = ["CommitRecord", "Cursor", "InvalidRecordError", "RolloutSums", "ScoredGroup"]


class InvalidRecordError(ValueError):
    """A record breaks one of its invariants; the message names the field."""


@dataclass(frozen=True, eq=False)
class ScoredGroup:
    """One prompt and its G responses, sampled and scored by one generator.

    Invariants (checked by `validate`, on write and on read):
      * G ≥ 1 responses; `response_tokens`, `behaviour_logprobs`, `rewards`, `raw_scores`,
        `truncated` and `finish_reasons` all have G entries;
      * len(response_tokens[i]) == len(behaviour_logprobs[i]) for every response i;
      * tokens are int32 ≥ 0; log-probs float32, finite and ≤ 0; rewards and raw scores finite;
      * policy_version ≥ 0 (0 = the initial weights).

    Fields:
        prompt_id: the dataset's id of the prompt.
        prompt_tokens: `[P] int32` the prompt as the engine saw it (chat template applied).
        ground_truth: the reference answer the reward function compared against.
        response_tokens: G arrays `[L_i] int32`.
        behaviour_logprobs: G arrays `[L_i] float32`, log π_behav of each sampled token.
        rewards: `[G] float32` reward after shaping (what the learner optimises).
        raw_scores: `[G] float32` the verifier's score before shaping (for metrics).
        truncated: `[G] bool` the response hit max_tokens without finishing.
        finish_reasons: G strings as the engine reported them ("stop", "length", ...).
        policy_version: weight version the responses were sampled with.
        generator_id: which generator produced the group.
        created_at, finished_at: UNIX times when the prompt was submitted and the group scored.
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

    @property
    def group_size(self) -> int:
        """G, the number of responses."""
        return len(self.response_tokens)

    @property
    def response_lengths(self) -> np.ndarray:
        """`[G] int64` tokens per response."""
        return np.array([len(t) for t in self.response_tokens], dtype=np.int64)

    @property
    def num_tokens(self) -> int:
        """Response tokens in the group."""
        return int(self.response_lengths.sum())

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
        return self

    def equals(self, other: ScoredGroup) -> bool:
        """Field-by-field equality (arrays compared by value and dtype-insensitive)."""

        def arrays_equal(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> bool:
            return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))

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
        )


def _check_tokens(tokens: np.ndarray, what: str) -> None:
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise InvalidRecordError(f"{what} must be a 1-d integer array")
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(np.int32).max):
        raise InvalidRecordError(f"{what} holds token ids outside int32 range [0, 2^31)")


@dataclass
class RolloutSums:
    """Sums over the responses of some groups, for rollout metrics (the learner's `rollout/*`;
    a commit record carries its segment's). A response is correct when its raw verifier score
    is ≥ 1; `reward` sums shaped rewards, `length` response tokens."""

    responses: int = 0
    reward: float = 0.0
    correct: int = 0
    length: int = 0
    truncated: int = 0

    def add(self, group: ScoredGroup) -> None:
        self.responses += group.group_size
        self.reward += float(np.sum(group.rewards, dtype=np.float64))
        self.correct += int(np.count_nonzero(np.asarray(group.raw_scores) >= 1.0))
        self.length += int(np.sum(group.response_lengths))
        self.truncated += int(np.count_nonzero(group.truncated))

    def merge(self, other: RolloutSums) -> None:
        self.responses += other.responses
        self.reward += other.reward
        self.correct += other.correct
        self.length += other.length
        self.truncated += other.truncated

    @classmethod
    def of(cls, groups: Sequence[ScoredGroup]) -> RolloutSums:
        sums = cls()
        for group in groups:
            sums.add(group)
        return sums

    def metrics(self, prefix: str) -> dict[str, float]:
        """`<prefix>/reward_mean`, `/acc`, `/response_len_mean`, `/truncated_frac`: means over
        responses."""
        n = max(self.responses, 1)
        return {
            f"{prefix}/reward_mean": self.reward / n,
            f"{prefix}/acc": self.correct / n,
            f"{prefix}/response_len_mean": self.length / n,
            f"{prefix}/truncated_frac": self.truncated / n,
        }


@dataclass(frozen=True)
class CommitRecord:
    """One entry of the commit log, `<run>/stream/log/<seq:012d>.json`.

    Invariants: `seq` is gap-free from 0 (each claimed once with create-if-absent); `segment`
    names an immutable folder under `<run>/stream/segments/` whose every object is listed in
    `objects` with its size and CRC32, uploaded before this record was written. A reader trusts
    only segments that a commit record names.

    Reward failures of the writer's generator, counted since the previous commit of the same
    writer incarnation (so summing them over the log counts every failure once; those after an
    incarnation's last commit are lost with its open segment):
      * `reward_errors`: reward calls that raised, returned a non-score or lost their worker;
      * `reward_timeouts`: reward calls killed at `generator.reward.timeout_s`;
      * `reward_dropped_groups`: groups left out of the stream because one of their calls
        failed (`generator.reward.on_error=drop_group`); none with `score_zero`, whose failed
        responses are in the segment with score 0.
    Records written before these fields existed read as 0.

    `rollout`: the sums of the segment's responses (`RolloutSums`), so a reader that skips a
    segment unread (all its groups too stale) still counts what it held; None in records
    written before the field existed (such segments are always read).
    """

    seq: int
    segment: str
    writer_id: str
    incarnation: str
    num_groups: int
    num_responses: int
    num_tokens: int
    min_policy_version: int
    max_policy_version: int
    objects: dict[str, tuple[int, int]] = field(default_factory=dict)
    committed_at: float = 0.0
    reward_errors: int = 0
    reward_timeouts: int = 0
    reward_dropped_groups: int = 0
    rollout: RolloutSums | None = None

    def to_json(self) -> bytes:
        rollout = None if self.rollout is None else asdict(self.rollout)
        objects = {k: list(v) for k, v in self.objects.items()}
        return json.dumps(
            {**self.__dict__, "objects": objects, "rollout": rollout}, sort_keys=True
        ).encode()

    @classmethod
    def from_json(cls, data: bytes, seq: int) -> CommitRecord:
        try:
            raw: dict[str, Any] = json.loads(data)
            raw["objects"] = {k: (int(v[0]), int(v[1])) for k, v in raw["objects"].items()}
            if raw.get("rollout") is not None:
                raw["rollout"] = RolloutSums(**raw["rollout"])
            record = cls(**raw)
        except (ValueError, TypeError, KeyError) as exc:
            raise InvalidRecordError(f"commit record {seq} is unreadable: {exc}") from None
        if record.seq != seq:
            raise InvalidRecordError(f"commit record {seq} claims seq {record.seq}")
        return record

    def same_commit(self, other: CommitRecord) -> bool:
        """True when `other` commits the same segment (a retried request found its own)."""
        return (self.segment, self.incarnation) == (other.segment, other.incarnation)


@dataclass(frozen=True, order=True)
class Cursor:
    """A reader's position: the next group is group `offset` of the segment committed at
    log number `seq`. Cursor(0, 0) is the start of the stream."""

    seq: int = 0
    offset: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"seq": self.seq, "offset": self.offset}

    @classmethod
    def from_dict(cls, data: dict[str, int]) -> Cursor:
        cursor = cls(int(data["seq"]), int(data.get("offset", 0)))
        if cursor.seq < 0 or cursor.offset < 0:
            raise InvalidRecordError(f"stream cursor must be non-negative, got {data}")
        return cursor
