"""A run's learner metrics as the history of its current training: which record of each step
counts, which records a resume rewrote or abandoned, and whether what is left is whole.

The learner logs one record per step (`streamrl.learner.reporting`): appended to
`metrics/learner.jsonl` on a local run, one object per step (rewritten in place) on an object
store; value pre-training records carry step 0 and `value_pretrain_step` k and come first. A
learner resumed from its checkpoint of step c trains steps c + 1, ... again and logs them
again. So a record of step s written after records of steps ≥ s means the learner went back to
step s − 1, and every earlier record of a step ≥ s belongs to training the resume discarded:
*rewritten* once the resumed learner logs that step again, *abandoned* while it has not (a
learner that crashed, was resumed, and stopped before it got that far). Positions are (step, k)
with k = 0 for a learner step, so pre-training (0, 1..K) sorts before step 1 and a restarted
pre-training (back to (0, 1)) discards the steps after it too. Write order: the JSONL's line
order; on an object store, each record's `time`.

`check_history` says what is wrong with the history, one sentence each: a step or pre-training
step with no record, a record whose stream counts do not add up (consumed = accepted + dropped
stale + dropped without signal, for the step and for the run so far), and a record whose totals
do not follow from the record before it (total = previous total + this step's count) — the mark
of two learners writing one run, or of records from different trainings mixed up.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from storage.fs import Location
from streamrl.learner.metrics_records import JSONL, MetricsFollower

__all__ = ["COUNTS", "MetricsHistory", "check_history", "metrics_history", "ranges"]

COUNTS = ("consumed", "accepted", "dropped_stale", "dropped_zero_var")
"""The learner's stream counts (`stream/<count>` for the step, `stream/<count>_total` for the
run so far; `streamrl.learner.batching.FilterCounts`)."""

Position = tuple[int, int]  # (step, value pre-training step or 0)


@dataclass(frozen=True)
class MetricsHistory:
    """`records`: the current history in position order, one record per position. `rewritten`:
    records a resumed learner replaced with a record of the same position. `abandoned`: the
    steps whose records belong to discarded training and were not logged again. `unplaced`:
    records without an integer step (they take no place in the history)."""

    records: tuple[dict[str, Any], ...] = ()
    rewritten: int = 0
    abandoned: tuple[int, ...] = ()
    unplaced: int = 0

    @property
    def last_step(self) -> int:
        """The last learner step logged (0 when none)."""
        return max((_position(r)[0] for r in self.records), default=0)

    def at_step(self, step: int) -> dict[str, Any] | None:
        """The record standing for the learner after `step` (step 0: the last value
        pre-training record), or None."""
        found = [r for r in self.records if _position(r)[0] == step]
        return found[-1] if found else None


def _position(record: dict[str, Any]) -> Position:
    return int(record["step"]), int(record.get("value_pretrain_step") or 0)


def _placed(record: dict[str, Any]) -> bool:
    step, k = record.get("step"), record.get("value_pretrain_step") or 0
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (step, k))


def metrics_history(run: Location) -> MetricsHistory:
    """The current history of the run's learner records (see the module docstring)."""
    written = MetricsFollower(run).read()
    if not run.fs.exists(run.join("metrics", JSONL)):  # one object per record: by time
        written.sort(key=lambda r: r.get("time", 0.0))
    kept: list[dict[str, Any]] = []
    dropped: list[Position] = []
    unplaced = 0
    for record in written:
        if not _placed(record):
            unplaced += 1
            continue
        position = _position(record)
        while kept and _position(kept[-1]) >= position:  # the learner went back: a resume
            dropped.append(_position(kept.pop()))
        kept.append(record)
    final = {_position(r) for r in kept}
    abandoned = sorted({step for step, k in dropped if (step, k) not in final and k == 0})
    return MetricsHistory(
        records=tuple(kept),
        rewritten=sum(position in final for position in dropped),
        abandoned=tuple(abandoned),
        unplaced=unplaced,
    )


def check_history(history: MetricsHistory, checkpoint_step: int | None) -> list[str]:
    """What is wrong with `history`, one sentence each (module docstring). Steps 1 to the last
    step logged, or to `checkpoint_step` when that is later, must each have a record."""
    problems = []
    if history.unplaced:
        problems.append(
            f"{history.unplaced} learner metrics record(s) carry no step number: no step can be "
            "told from them"
        )
    positions = [_position(r) for r in history.records]
    steps = {step for step, k in positions if k == 0 and step >= 1}
    last = max(history.last_step, checkpoint_step or 0)
    if missing := sorted(set(range(1, last + 1)) - steps):
        checkpointed = (
            f" (the checkpoint is at step {checkpoint_step})"
            if checkpoint_step is not None and checkpoint_step > history.last_step
            else ""
        )
        problems.append(
            f"no learner metrics record of step(s) {ranges(missing)} of 1..{last}{checkpointed}: "
            "what those steps did is lost"
        )
    pretrain = sorted(k for step, k in positions if step == 0 and k >= 1)
    if pretrain and (gaps := sorted(set(range(1, pretrain[-1] + 1)) - set(pretrain))):
        problems.append(f"no metrics record of value pre-training step(s) {ranges(gaps)}")
    for record in history.records:
        problems.extend(_unbalanced(record))
    for before, after in zip(history.records, history.records[1:], strict=False):
        if _adjacent(_position(before), _position(after)):
            problems.extend(_not_following(before, after))
    return problems


def _where(record: dict[str, Any]) -> str:
    step, k = _position(record)
    return f"value pre-training step {k}" if k else f"step {step}"


def _count(record: dict[str, Any], name: str) -> int | None:
    value = record.get(f"stream/{name}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return round(value)


def _unbalanced(record: dict[str, Any]) -> Iterator[str]:
    """consumed ≠ accepted + dropped, for the step and for the run so far."""
    for suffix, scope in (("", "the step"), ("_total", "the run so far")):
        consumed, *parts = (_count(record, f"{name}{suffix}") for name in COUNTS)
        if consumed is None or any(part is None for part in parts):
            continue
        if consumed != sum(parts):
            accepted, stale, no_signal = parts
            yield (
                f"learner metrics of {_where(record)}: {consumed} groups consumed in "
                f"{scope}, but {accepted} trained + {stale} dropped stale + {no_signal} "
                f"dropped without signal = {sum(parts)}"
            )


def _adjacent(before: Position, after: Position) -> bool:
    """Whether `after` is the position right after `before` (no record missing between)."""
    if after[1]:  # value pre-training step k follows k - 1
        return after == (0, before[1] + 1)
    return after[0] == before[0] + 1 and (before[1] == 0 or after[0] == 1)


def _not_following(before: dict[str, Any], after: dict[str, Any]) -> Iterator[str]:
    """The totals of `after` that are not `before`'s total plus `after`'s own count."""
    off = []
    for name in COUNTS:
        previous, step, total = (
            _count(before, f"{name}_total"),
            _count(after, name),
            _count(after, f"{name}_total"),
        )
        if None not in (previous, step, total) and total != previous + step:
            off.append(f"stream/{name}_total {total} ≠ {previous} + {step}")
    if off:
        yield (
            f"learner metrics of {_where(after)} do not follow {_where(before)}: "
            f"{', '.join(off)} (the total before + this step's count): records of different "
            "trainings are mixed, or two learners wrote this run"
        )


def ranges(numbers: list[int]) -> str:
    """Sorted `numbers` as "1-3, 7, 9-10"."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
