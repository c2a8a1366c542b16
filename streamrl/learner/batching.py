"""Choosing which stream groups form a batch: the learner's group selection.

Consumes `ScoredGroup`s (a `StreamReader.groups()` iterator) and the reader's cursor. Produces
a `StreamBatch` of B accepted groups — or, with `batch_tokens` (the framework guide's
length-aware batches, Alg. 3), of fewer once the accepted groups hold that many response tokens,
the group that reaches it included — with the cursor after the last one consumed and what the
filters did (`FilterCounts`); turning its groups into tensors is `streamrl.learner.mini_batches`.

Filters, in order (a group dropped by the first is not counted by the second): staleness,
`current_version − policy_version > max_staleness` (a segment whose commit record shows every
group stale arrives as a `SkippedSegment`, never downloaded, and counts as that many stale
groups: the same counts and cursor as reading them); then, with dynamic sampling on, a group
without signal: all responses equally correct (raw verifier scores all equal — for a binary
verifier, not 0 < #correct < G). Correctness decides, never the shaped reward: an all-wrong
group whose overlong penalties differ teaches nothing about correctness. Reading on until B
groups pass *is* DAPO's dynamic sampling, done by streaming. When the data is too easy or too
hard for the model, every group is alike and no batch fills: a warning says so after
`STARVED_BATCHES` batches' worth of groups in a row without signal, and again each time that
run doubles; the run's length (`BatchCollector.no_signal`) goes into the learner's progress
record, so the condition is read from storage too (`streamrl.runs.health`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np

from storage.stream.reader import SkippedSegment
from storage.stream.records import Cursor, RolloutSums, ScoredGroup

__all__ = [
    "NO_SIGNAL",
    "STALE",
    "STARVED_BATCHES",
    "BatchCollector",
    "FilterCounts",
    "IncompatibleGroupError",
    "StreamBatch",
    "drop_reason",
    "is_starved",
    "oldest_usable_version",
    "starvation_warning",
]


STARVED_BATCHES = 4
"""Groups without signal in a row, in batches, before the learner warns that it is starved."""

STALE, NO_SIGNAL = "stale", "no_signal"
"""Why the filters drop a group (`drop_reason`): counted as dropped_stale / dropped_zero_var."""


def oldest_usable_version(current_version: int, max_staleness: int) -> int:
    """The oldest policy version a group may have to pass the staleness filter at
    `current_version` (never decreases as the version grows)."""
    return current_version - max_staleness


def drop_reason(group: ScoredGroup, oldest_usable: int, dynamic_sampling: bool) -> str | None:
    """Which filter drops `group` (module docstring), first match: `STALE` when its
    policy_version < `oldest_usable` (current − policy_version > max_staleness), `NO_SIGNAL`
    with `dynamic_sampling` when its responses are all equally correct (raw scores all equal);
    None when it passes both."""
    if group.policy_version < oldest_usable:
        return STALE
    if dynamic_sampling and np.ptp(group.raw_scores) == 0:
        return NO_SIGNAL
    return None


log = logging.getLogger(__name__)


def is_starved(no_signal: int, batch_groups: int) -> bool:
    """Whether `no_signal` groups in a row without signal starve a learner of B =
    `batch_groups`: `STARVED_BATCHES` batches' worth or more."""
    return no_signal >= STARVED_BATCHES * batch_groups


def starvation_warning(correct: int, wrong: int) -> str:
    """What a learner starved by `correct` groups in a row with every response correct and
    `wrong` with every response wrong is told: the cause and what to change."""
    easy = correct >= wrong
    fix = "harder prompts" if easy else "easier prompts, or a warm start (supervised: docs/sft.md)"
    return (
        f"no signal in the last {correct + wrong} groups: {correct} had every response correct, "
        f"{wrong} every response wrong; dynamic sampling drops such groups, so the batch cannot "
        f"fill. The data is too {'easy' if easy else 'hard'} for the model now: train on {fix}, "
        "or set algorithm.dynamic_sampling=false to train on them anyway (with a group "
        "baseline they add nothing)"
    )


class IncompatibleGroupError(ValueError):
    """A stream group the model cannot train on; the message names the group and the fix."""


@dataclass
class FilterCounts:
    """Groups read from the stream and what the filters did with them; `skipped_segments`
    counts the segments whose groups were all stale by their commit record and were counted in
    `consumed` and `dropped_stale` without being downloaded (how many depends on how far the
    reader had read ahead: the other counts do not)."""

    consumed: int = 0
    accepted: int = 0
    dropped_stale: int = 0
    dropped_zero_var: int = 0
    skipped_segments: int = 0

    def __add__(self, other: FilterCounts) -> FilterCounts:
        return FilterCounts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


@dataclass(frozen=True)
class StreamBatch:
    """B accepted groups in stream order; `cursor_after` is the reader position just past the
    last group consumed (accepted or dropped): checkpoint it to resume at the next group.
    `staleness: [B] int64` = current_version − policy_version per group; `counts` covers this
    batch, `totals` every batch of the collector so far; `consumed` sums the responses of every
    group this batch consumed, accepted or dropped (what the generators produced; a segment
    skipped unread contributes the sums its commit record carries)."""

    groups: tuple[ScoredGroup, ...]
    cursor_after: Cursor
    counts: FilterCounts
    totals: FilterCounts
    staleness: np.ndarray
    consumed: RolloutSums = field(default_factory=RolloutSums)

    def metrics(self) -> dict[str, float]:
        """`stream/staleness_mean`, `_max`, `stream/dropped_stale`, `stream/dropped_zero_var`
        (docs/algorithms.md), `stream/accepted`, `stream/consumed`, `stream/skipped_segments`;
        `stream/*_total` cumulative; `stream/waste_frac` (consumed but not trained on) and
        `stream/stale_frac` (dropped as stale) over every group consumed so far; `rollout/*`
        over every consumed group and
        `rollout_accepted/*` over the trained ones."""
        counts = {f"stream/{k}": float(v) for k, v in asdict(self.counts).items()}
        totals = {f"stream/{k}_total": float(v) for k, v in asdict(self.totals).items()}
        mean, top = float(self.staleness.mean()), float(self.staleness.max())
        rollout = self.consumed.metrics("rollout")
        accepted = RolloutSums.of(self.groups).metrics("rollout_accepted")
        staleness = {"stream/staleness_mean": mean, "stream/staleness_max": top}
        consumed = max(self.totals.consumed, 1)
        waste = {  # of every group consumed so far: not trained on, dropped as stale
            "stream/waste_frac": (self.totals.consumed - self.totals.accepted) / consumed,
            "stream/stale_frac": self.totals.dropped_stale / consumed,
        }
        return staleness | counts | totals | waste | rollout | accepted


@dataclass
class BatchCollector:
    """Reads groups until `batch_groups` pass the staleness and dynamic-sampling filters, or
    (`batch_tokens`) until those that passed hold `batch_tokens` response tokens.

    Every consumed group that was read is first checked against the model (token ids <
    `vocab_size`, prompt + response ≤ `max_seq_len`) and, with `needs_teacher` (on-policy
    distillation), for its teacher log-probs; a mismatch raises `IncompatibleGroupError` (a
    stream written for another model or without a teacher is a user error, not data to skip).
    `totals` counts every batch so far: keep it in the learner state and pass it back on
    resume. `oldest_usable(version)` is the staleness rule as a bound, for the stream reader.
    `pending_accepted`: the groups accepted for the batch being collected, or collected and not
    yet trained on (the owner sets it back to 0 once their step is done); another thread may
    read it at any time, for the learner's progress record."""

    batch_groups: int
    max_staleness: int
    dynamic_sampling: bool
    vocab_size: int
    max_seq_len: int
    totals: FilterCounts = field(default_factory=FilterCounts)
    batch_tokens: int | None = None
    needs_teacher: bool = False
    pending_accepted: int = field(default=0, init=False)
    _alike: list[int] = field(default_factory=lambda: [0, 0], init=False)  # correct, wrong

    @property
    def no_signal(self) -> tuple[int, int]:
        """The groups in a row, since the last one accepted, that dynamic sampling dropped:
        (every response correct, every response wrong). Read by another thread for the
        learner's progress record: a count one group behind is harmless there."""
        correct, wrong = self._alike
        return correct, wrong

    def oldest_usable(self, current_version: int) -> int:
        """`oldest_usable_version` at `current_version` under this collector's max_staleness."""
        return oldest_usable_version(current_version, self.max_staleness)

    def collect(
        self,
        groups: Iterator[ScoredGroup | SkippedSegment],
        cursor: Callable[[], Cursor],
        current_version: int,
    ) -> StreamBatch:
        """Consume `groups` until the batch is full (B accepted, or `batch_tokens`), reading
        `cursor()` after each one. `EOFError` if the iterator ends first (a StreamReader raises
        `StreamTimeoutError` instead)."""
        accepted: list[ScoredGroup] = []
        self.pending_accepted = 0
        tokens, full = 0, False
        counts, after, consumed = FilterCounts(), cursor(), RolloutSums()
        oldest = self.oldest_usable(current_version)
        for group in groups:  # a StreamReader's cursor is past `group` once it is yielded
            after = cursor()
            if isinstance(group, SkippedSegment):
                if group.max_policy_version >= oldest:
                    raise ValueError(
                        f"the stream reader skipped segment {group.seq} (versions up to "
                        f"{group.max_policy_version}) although versions ≥ {oldest} are still "
                        "trained on"
                    )
                counts.consumed += group.num_groups
                counts.dropped_stale += group.num_groups
                counts.skipped_segments += 1
                consumed.merge(group.rollout)
                continue
            counts.consumed += 1
            self.check(group)
            consumed.add(group)
            reason = drop_reason(group, oldest, self.dynamic_sampling)
            if reason == STALE:
                counts.dropped_stale += 1
            elif reason == NO_SIGNAL:
                counts.dropped_zero_var += 1
                self._alike[0 if group.raw_scores[0] >= 1 else 1] += 1
                self._warn_if_starved()
            else:
                self._alike = [0, 0]
                accepted.append(group)
                self.pending_accepted = len(accepted)
                tokens += sum(len(t) for t in group.response_tokens)
                full = len(accepted) == self.batch_groups or (
                    self.batch_tokens is not None and tokens >= self.batch_tokens
                )
                if full:
                    break
        if not full:
            raise EOFError(f"the stream ended with {len(accepted)}/{self.batch_groups} accepted")
        counts.accepted = len(accepted)
        self.totals = self.totals + counts
        staleness = np.array([current_version - g.policy_version for g in accepted], np.int64)
        totals = replace(self.totals)
        return StreamBatch(tuple(accepted), after, counts, totals, staleness, consumed)

    def _warn_if_starved(self) -> None:
        """The warning of a learner that dynamic sampling starves (module docstring)."""
        alike = sum(self._alike)
        batches, rest = divmod(alike, STARVED_BATCHES * self.batch_groups)
        if rest or batches & (batches - 1) or not batches:  # at 1, 2, 4, 8... × the bound
            return
        log.warning("%s", starvation_warning(*self.no_signal))

    def check(self, group: ScoredGroup) -> None:
        """Raise `IncompatibleGroupError` if the model cannot train on `group`."""
        where = f"group {group.prompt_id!r} from generator {group.generator_id!r}"
        hint = "was the stream written with another tokenizer/model?"
        pieces = [np.asarray(group.prompt_tokens), *map(np.asarray, group.response_tokens)]
        tokens = np.concatenate(pieces)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise IncompatibleGroupError(
                f"{where} holds token id {int(tokens.max())} outside the model's vocabulary "
                f"[0, {self.vocab_size}); {hint}"
            )
        if self.needs_teacher and group.teacher_logprobs is None:
            raise IncompatibleGroupError(
                f"{where} carries no teacher log-probs, but algorithm.opd (on-policy "
                "distillation) trains on them: give the generators a teacher "
                "(generator.teacher), or set algorithm.opd=null"
            )
        longest = len(pieces[0]) + max(len(p) for p in pieces[1:])
        if longest > self.max_seq_len:
            raise IncompatibleGroupError(
                f"{where} has a {longest}-token prompt + response, longer than the model's "
                f"max_seq_len {self.max_seq_len}; {hint} (else raise model.max_model_len)"
            )
