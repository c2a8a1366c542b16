"""The replay stream's wire records: `ScoredGroup` (one prompt and its G scored responses,
defined in `storage.stream.scored_group`), `CommitRecord` (one entry of the commit log), the
`RolloutSums` it carries, and `Cursor` (a reader's position).

These are the boundary between generators and the learner; both sides validate them.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from storage.stream.scored_group import TASK_NAME, InvalidRecordError, ScoredGroup

__all__ = [
    "WRITER_ID",
    "CommitRecord",
    "Cursor",
    "InvalidRecordError",
    "RolloutSums",
    "ScoredGroup",
    "segment_name",
]


@dataclass
class RolloutSums:
    """Sums over the responses of some groups, for rollout metrics (the learner's `rollout/*`;
    a commit record carries its segment's). A response is correct when its raw verifier score
    is ≥ 1; `reward` sums shaped rewards, `length` sampled tokens (docs/algorithms.md: lengths count
    sampled tokens), `env_tokens` environment tokens (multi-turn), `turns` model turns;
    `tool_calls`, `tool_errors`, `env_s` and `wait_s` the episode statistics
    (`ScoredGroup.tool_calls`, ...); `finished` counts responses by finish reason. Episodes
    whose environment rewards each turn: `turn_reward[i]` sums the rewards of turn i + 1 and
    `turn_rewarded[i]` counts them; `full_episodes` counts episodes with a turn rewarded 1 and
    `turns_to_full` sums the number of that first such turn. Rewards of several terms
    (`ScoredGroup.reward_terms`): `reward_terms[name]` sums term `name` over responses;
    `teacher_groups` counts groups a teacher scored and `teacher_s` sums their
    `teacher_seconds` (0 where not timed). `tools_offered` counts responses whose environment
    offered the model tools. Groups with a task (`ScoredGroup.task`): `task_responses[t]` and
    `task_correct[t]` count task t's responses and the correct ones (past `MAX_TASKS` distinct
    tasks, the rest are counted as `other`)."""

    responses: int = 0
    reward: float = 0.0
    correct: int = 0
    length: int = 0
    truncated: int = 0
    env_tokens: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    env_s: float = 0.0
    wait_s: float = 0.0
    finished: dict[str, int] = field(default_factory=dict)
    turn_reward: list[float] = field(default_factory=list)
    turn_rewarded: list[int] = field(default_factory=list)
    full_episodes: int = 0
    turns_to_full: int = 0
    reward_terms: dict[str, float] = field(default_factory=dict)
    teacher_groups: int = 0
    teacher_s: float = 0.0
    tools_offered: int = 0
    task_responses: dict[str, int] = field(default_factory=dict)
    task_correct: dict[str, int] = field(default_factory=dict)

    def add(self, group: ScoredGroup) -> None:
        sampled = int(np.sum(group.sampled_lengths))
        self.responses += group.group_size
        self.reward += float(np.sum(group.rewards, dtype=np.float64))
        self.correct += int(np.count_nonzero(np.asarray(group.raw_scores) >= 1.0))
        self.length += sampled
        self.truncated += int(np.count_nonzero(group.truncated))
        self.env_tokens += group.num_tokens - sampled
        self.turns += int(np.sum(group.effective_turns, dtype=np.int64))
        self.tool_calls += int(np.sum(group.episode_stat("tool_calls"), dtype=np.int64))
        self.tool_errors += int(np.sum(group.episode_stat("tool_errors"), dtype=np.int64))
        self.env_s += float(np.sum(group.episode_stat("env_seconds"), dtype=np.float64))
        self.wait_s += float(np.sum(group.episode_stat("wait_seconds"), dtype=np.float64))
        self.tools_offered += group.group_size if group.tools_offered else 0
        for reason in group.finish_reasons:
            self.finished[reason] = self.finished.get(reason, 0) + 1
        for rewards in group.effective_turn_rewards:
            self._add_turns([float(r) for r in rewards], [1] * len(rewards))
            full = np.flatnonzero(np.asarray(rewards) >= 1.0)
            if full.size:
                self.full_episodes += 1
                self.turns_to_full += int(full[0]) + 1
        for name, values in (group.reward_terms or {}).items():
            total = float(np.sum(values, dtype=np.float64))
            self.reward_terms[name] = self.reward_terms.get(name, 0.0) + total
        if group.teacher_logprobs is not None:
            self.teacher_groups += 1
            self.teacher_s += group.teacher_seconds or 0.0
        if group.task is not None:
            correct = int(np.count_nonzero(np.asarray(group.raw_scores) >= 1.0))
            self._add_task(group.task, group.group_size, correct)

    def _add_task(self, task: str, responses: int, correct: int) -> None:
        if task not in self.task_responses and len(self.task_responses) >= MAX_TASKS:
            task = OTHER_TASKS
        self.task_responses[task] = self.task_responses.get(task, 0) + responses
        self.task_correct[task] = self.task_correct.get(task, 0) + correct

    def _add_turns(self, rewards: Sequence[float], counts: Sequence[int]) -> None:
        grow = len(rewards) - len(self.turn_reward)
        if grow > 0:
            self.turn_reward += [0.0] * grow
            self.turn_rewarded += [0] * grow
        for i, (reward, count) in enumerate(zip(rewards, counts, strict=True)):
            self.turn_reward[i] += reward
            self.turn_rewarded[i] += count

    def merge(self, other: RolloutSums) -> None:
        for name in _SUMMED:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for reason, count in other.finished.items():
            self.finished[reason] = self.finished.get(reason, 0) + count
        self._add_turns(other.turn_reward, other.turn_rewarded)
        for name, total in other.reward_terms.items():
            self.reward_terms[name] = self.reward_terms.get(name, 0.0) + total
        for task, responses in other.task_responses.items():
            self._add_task(task, responses, other.task_correct.get(task, 0))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RolloutSums:
        """The sums a commit record stored. Records written before multi-turn rollouts lack
        `env_tokens` and `turns` (their responses were single-turn: no environment token, one
        turn each), and before episode statistics the fields after `turns` (read as 0; the
        reward terms as none)."""
        data = {"env_tokens": 0, "turns": data.get("responses", 0), **data}
        return cls(**data)

    @classmethod
    def of(cls, groups: Sequence[ScoredGroup]) -> RolloutSums:
        sums = cls()
        for group in groups:
            sums.add(group)
        return sums

    def metrics(self, prefix: str) -> dict[str, float]:
        """`<prefix>/reward_mean`, `/acc`, `/response_len_mean` (sampled tokens),
        `/truncated_frac`, `/env_tokens_mean`, `/turns_mean`, `/tool_calls_mean`,
        `/tool_errors_mean`, `/env_s_mean`, `/wait_s_mean`: means over responses;
        `/finish_<reason>_frac` for each finish reason seen; with turn rewards,
        `/turn<i>_reward_mean` over the episodes that reached turn i and `/turns_to_full_mean`
        over the episodes with a turn rewarded 1; `/teacher_s_per_group` over the groups a
        teacher scored, when any; `/tools_offered_frac`, the share of responses offered tools,
        when any. Each reward term's mean R_k over all responses (one without
        the term counts 0) is `reward/<term>_mean` (docs/algorithms.md's name) for the prefix
        `rollout`, `reward_accepted/<term>_mean` for `rollout_accepted`. Each task's accuracy
        over its responses is `task/<task>/acc` (`task_accepted/...` for `rollout_accepted`)."""
        n = max(self.responses, 1)
        return {
            f"{prefix}/reward_mean": self.reward / n,
            f"{prefix}/acc": self.correct / n,
            f"{prefix}/response_len_mean": self.length / n,
            f"{prefix}/truncated_frac": self.truncated / n,
            f"{prefix}/env_tokens_mean": self.env_tokens / n,
            f"{prefix}/turns_mean": self.turns / n,
            f"{prefix}/tool_calls_mean": self.tool_calls / n,
            f"{prefix}/tool_errors_mean": self.tool_errors / n,
            f"{prefix}/env_s_mean": self.env_s / n,
            f"{prefix}/wait_s_mean": self.wait_s / n,
            **{
                f"{prefix}/finish_{reason}_frac": count / n
                for reason, count in sorted(self.finished.items())
            },
            **{
                f"{prefix}/turn{i + 1}_reward_mean": total / count
                for i, (total, count) in enumerate(
                    zip(self.turn_reward, self.turn_rewarded, strict=True)
                )
                if count
            },
            **(
                {f"{prefix}/turns_to_full_mean": self.turns_to_full / self.full_episodes}
                if self.full_episodes
                else {}
            ),
            **{
                f"{prefix.replace('rollout', 'reward', 1)}/{name}_mean": total / n
                for name, total in sorted(self.reward_terms.items())
            },
            **(
                {f"{prefix}/teacher_s_per_group": self.teacher_s / self.teacher_groups}
                if self.teacher_groups
                else {}
            ),
            **(
                {f"{prefix}/tools_offered_frac": self.tools_offered / n}
                if self.tools_offered
                else {}
            ),
            **{
                f"{prefix.replace('rollout', 'task', 1)}/{task}/acc": self.task_correct.get(task, 0)
                / count
                for task, count in sorted(self.task_responses.items())
                if count
            },
        }


_KEYED = (
    "finished",
    "turn_reward",
    "turn_rewarded",
    "reward_terms",
    "task_responses",
    "task_correct",
)
_SUMMED = tuple(f.name for f in fields(RolloutSums) if f.name not in _KEYED)
MAX_TASKS = 64
"""Distinct tasks a `RolloutSums` counts apart; more are counted together as `OTHER_TASKS`."""
OTHER_TASKS = "other"


WRITER_ID = re.compile(r"[A-Za-z0-9_.]+")
"""A writer id (`gen3`): it starts every segment name of the writer, so it holds no '-' or '/'."""

_INCARNATION = re.compile(r"[0-9a-f]+")
_SEGMENT_NUMBER = re.compile(r"[0-9]{6,}")
_OBJECT_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*")
"""A Zarr key relative to its segment (`zarr.json`, `rewards/c/0`): no empty, `.` or `..` part,
no leading '/', so the object lies inside its segment's folder."""

_REWARD_FAILURES = ("reward_errors", "reward_timeouts", "reward_dropped_groups")
GENERATOR_COUNTS = (*_REWARD_FAILURES, "judge_verdicts", "judge_unparsed")
"""What a writer counts between its commits and each commit record carries (`CommitRecord`)."""


def segment_name(writer_id: str, incarnation: str, number: int) -> str:
    """The folder name, under `<run>/stream/segments/`, of a writer incarnation's `number`-th
    segment: `<writer>-<incarnation>-<number:06d>`, the only names a commit record may name."""
    return f"{writer_id}-{incarnation}-{number:06d}"


def _check_int(value: object, minimum: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidRecordError(f"{what} must be an integer ≥ {minimum}, got {value!r}")


def _check_finite(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRecordError(f"{what} must be a finite number, got {value!r}")


@dataclass(frozen=True)
class CommitRecord:
    """One entry of the commit log, `<run>/stream/log/<seq:012d>.json`.

    Invariants (checked on construction, so on every read): `seq` is gap-free from 0 (each
    claimed once with create-if-absent; -1 while a writer has not claimed one yet); `segment`
    is `segment_name(writer_id, incarnation, n)`, an immutable folder directly under
    `<run>/stream/segments/` whose every object is listed in `objects` (a key relative to the
    segment, never leaving it: `_OBJECT_KEY`) with its size and CRC32, uploaded before this
    record was written; counts are ≥ 0 and min_policy_version ≤ max_policy_version. A reader
    trusts only segments that a commit record names, and only paths these rules allow.

    A stored record that breaks them is read as a *rejected* record (`rejected_record`): the
    reason in `rejected`, no segment, no object, every count 0. Readers quarantine it; retention
    and the sweeper touch no path for it.

    Reward failures of the writer's generator, counted since the previous commit of the same
    writer incarnation (so summing them over the log counts every failure once; those after an
    incarnation's last commit are lost with its open segment):
      * `reward_errors`: reward calls that raised, returned a non-score or lost their worker;
      * `reward_timeouts`: reward calls killed at `generator.reward.timeout_s`;
      * `reward_dropped_groups`: groups left out of the stream because one of their calls
        failed (`generator.reward.on_error=drop_group`); none with `score_zero`, whose failed
        responses are in the segment with score 0.
    And, counted the same way, the verdicts of the reward's judge terms: `judge_verdicts` the
    judges' answers read, `judge_unparsed` those without a verdict on their scale
    (`streamrl.scorers.terms`: scored by the term's `on_unparsed` rule), so
    judge/unparsed_frac = unparsed / verdicts.
    Records written before these fields existed read as 0.

    `rollout`: the sums of the segment's responses (`RolloutSums`), so a reader that skips a
    segment unread (all its groups too stale) still counts what it held; None in records
    written before the field existed (such segments are always read). `num_tokens` counts every
    response token the segment stores, sampled and environment tokens alike.
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
    judge_verdicts: int = 0
    judge_unparsed: int = 0
    rollout: RolloutSums | None = None
    rejected: str = ""  # never stored: why a stored record was rejected (`rejected_record`)

    def __post_init__(self) -> None:
        where = f"commit record {self.seq}"
        if self.rejected:
            if self.segment or self.objects or self.num_groups:
                raise InvalidRecordError(f"{where}: a rejected record names no segment")
            return
        _check_int(self.seq, -1, f"{where}: seq")
        for name in ("num_groups", "num_responses", "num_tokens", "min_policy_version",
                     *GENERATOR_COUNTS):  # fmt: skip
            _check_int(getattr(self, name), 0, f"{where}: {name}")
        if self.judge_unparsed > self.judge_verdicts:
            raise InvalidRecordError(f"{where}: judge_unparsed exceeds judge_verdicts")
        _check_int(self.max_policy_version, self.min_policy_version, f"{where}: max_policy_version")
        if self.rollout is not None:
            self._check_rollout(where)
        if self.seq == -1 and not self.segment:  # a writer's record before it names its upload
            return
        self._check_segment(where)
        self._check_objects(where)

    def _check_rollout(self, where: str) -> None:
        rollout = self.rollout
        if not isinstance(rollout, RolloutSums):
            raise InvalidRecordError(f"{where}: rollout must be RolloutSums, got {rollout!r}")
        counts = ("responses", "correct", "length", "truncated", "env_tokens", "turns",
                  "tool_calls", "tool_errors", "full_episodes", "turns_to_full",
                  "teacher_groups")  # fmt: skip
        for name in counts:
            _check_int(getattr(rollout, name), 0, f"{where}: rollout.{name}")
        for name in ("reward", "env_s", "wait_s", "teacher_s"):
            _check_finite(getattr(rollout, name), f"{where}: rollout.{name}")
        terms = rollout.reward_terms
        if not isinstance(terms, dict) or not all(isinstance(k, str) for k in terms):
            raise InvalidRecordError(f"{where}: rollout.reward_terms must map term names to sums")
        for name, total in terms.items():
            _check_finite(total, f"{where}: rollout.reward_terms[{name!r}]")
        for name in ("task_responses", "task_correct"):
            tasks = getattr(rollout, name)
            if not isinstance(tasks, dict) or not all(
                isinstance(k, str) and TASK_NAME.fullmatch(k) for k in tasks
            ):
                raise InvalidRecordError(f"{where}: rollout.{name} must map task names to counts")
            for task, count in tasks.items():
                _check_int(count, 0, f"{where}: rollout.{name}[{task!r}]")
        if any(rollout.task_correct.get(t, 0) > n for t, n in rollout.task_responses.items()):
            raise InvalidRecordError(f"{where}: rollout.task_correct exceeds task_responses")
        finished = rollout.finished
        if not isinstance(finished, dict) or not all(isinstance(k, str) for k in finished):
            raise InvalidRecordError(f"{where}: rollout.finished must map finish reasons to counts")
        for reason, count in finished.items():
            _check_int(count, 0, f"{where}: rollout.finished[{reason!r}]")
        sums, counts_ = rollout.turn_reward, rollout.turn_rewarded
        if not isinstance(sums, list) or not isinstance(counts_, list) or len(sums) != len(counts_):
            raise InvalidRecordError(f"{where}: rollout.turn_reward and turn_rewarded must be "
                                     "lists of one length")  # fmt: skip
        for i, (total, count) in enumerate(zip(sums, counts_, strict=True)):
            _check_int(count, 0, f"{where}: rollout.turn_rewarded[{i}]")
            _check_finite(total, f"{where}: rollout.turn_reward[{i}]")

    def _check_segment(self, where: str) -> None:
        if not isinstance(self.writer_id, str) or not WRITER_ID.fullmatch(self.writer_id):
            raise InvalidRecordError(f"{where}: writer_id {self.writer_id!r} is not a writer id")
        if not isinstance(self.incarnation, str) or not _INCARNATION.fullmatch(self.incarnation):
            raise InvalidRecordError(f"{where}: incarnation {self.incarnation!r} is not hex")
        prefix = f"{self.writer_id}-{self.incarnation}-"
        segment = self.segment
        if not (
            isinstance(segment, str)
            and segment.startswith(prefix)
            and _SEGMENT_NUMBER.fullmatch(segment[len(prefix) :])
        ):
            raise InvalidRecordError(
                f"{where}: segment {segment!r} breaks the naming rule: a record names its own "
                f"writer's segment, {prefix}<6+ digits>, directly under stream/segments/"
            )

    def _check_objects(self, where: str) -> None:
        if not isinstance(self.objects, dict) or not self.objects:
            raise InvalidRecordError(f"{where}: objects must list the segment's objects")
        for key, entry in self.objects.items():
            if not isinstance(key, str) or not _OBJECT_KEY.fullmatch(key):
                raise InvalidRecordError(
                    f"{where}: objects key {key!r} breaks the naming rule: a key relative to "
                    "its segment, of letters, digits, '_', '.', '-' and '/', with no '.' or "
                    "'..' part"
                )
            size, crc = entry
            _check_int(size, 0, f"{where}: objects[{key!r}] size")
            _check_int(crc, 0, f"{where}: objects[{key!r}] CRC32")

    @classmethod
    def rejected_record(cls, seq: int, reason: str) -> CommitRecord:
        """What a stored record at `seq` that breaks the invariants reads as (see the class)."""
        return cls(seq, "", "", "", 0, 0, 0, 0, 0, rejected=reason or "rejected")

    def to_json(self) -> bytes:
        if self.rejected:
            raise InvalidRecordError(f"commit record {self.seq} was rejected; it is never stored")
        rollout = None if self.rollout is None else asdict(self.rollout)
        objects = {k: list(v) for k, v in self.objects.items()}
        body = {**self.__dict__, "objects": objects, "rollout": rollout}
        del body["rejected"]
        return json.dumps(body, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, seq: int) -> CommitRecord:
        """The stored record `seq`; raises `InvalidRecordError` naming what is wrong."""
        try:
            raw: dict[str, Any] = json.loads(data)
            if "rejected" in raw:
                raise ValueError("'rejected' is not a stored field")
            raw["objects"] = {k: (int(v[0]), int(v[1])) for k, v in raw["objects"].items()}
            if raw.get("rollout") is not None:
                raw["rollout"] = RolloutSums.from_dict(raw["rollout"])
        except InvalidRecordError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError, IndexError) as exc:
            raise InvalidRecordError(f"commit record {seq} is unreadable: {exc}") from None
        try:
            record = cls(**raw)
        except TypeError as exc:
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
