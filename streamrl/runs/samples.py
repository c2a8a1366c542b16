"""`streamrl samples`: what the model wrote, decoded straight from a run's replay stream.

Committed groups are read with the project's stream reader (`StreamReader.poll`: every object's
size and CRC32 checked; like every reader it quarantines a corrupt segment, leaving a note under
`stream/quarantine/`); the responses that match a `SampleFilter` are decoded into `Sample`s
(`streamrl.learner.samples`), each with what the learner did with it.

What the learner consumed is derived from its metrics records (`<run>/metrics/learner*`), never
guessed: each record holds `stream/consumed_total`, the groups consumed so far — in commit
order, quarantined segments left out, a segment skipped unread as too stale counted whole — so
the n-th group of the stream was consumed by the first record whose total exceeds n
(`ConsumedGroups`). The version the learner read it at is the `policy_version` of the record of
the step before (the initial weights, version 0, for step 1 and value pre-training); the filters
are the learner's own (`streamrl.learner.samples.filter_reason`) under the run's current
configuration. Where a record is missing the sample says so (`Sample.learner_note`) instead.

Which samples: the newest `limit` that match (the stream read backwards, `WINDOW` commit
records at a time), or with `step` the first `limit` that step consumed; in stream order either
way. Segments released by retention (`storage.stream_retention=consumed`) are gone: their
groups are passed over, and a step that lies in them is refused, naming the setting.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from storage.fs import Location
from storage.stream.reader import StreamReader
from storage.stream.records import CommitRecord, Cursor, ScoredGroup
from storage.stream.retention import read_retention
from storage.stream.writer import quarantined, read_log
from streamrl.config.run import RunConfig
from streamrl.learner.batching import drop_reason, oldest_usable_version
from streamrl.learner.metrics_records import MetricsFollower, in_order, read_metrics
from streamrl.learner.samples import Sample, SampleDecoder, batch_samples, consumed, task_of

__all__ = [
    "WINDOW",
    "ConsumedGroups",
    "SampleFilter",
    "SampleReport",
    "SamplesError",
    "StepSampler",
    "read_samples",
    "step_samples",
]

WINDOW = 16
"""Commit records read per round."""


class SamplesError(ValueError):
    """A selection that cannot be read (a step the learner has no record of, a released one)."""


@dataclass(frozen=True)
class SampleFilter:
    """Which responses to show: consumed by learner `step` (when known); sampled in part by
    weight `version`; reward within [`min_reward`, `max_reward`]; of dataset `task` (the prompt
    id less its row); with a failed tool call (`failed_tools`); at most `limit`."""

    step: int | None = None
    version: int | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    task: str | None = None
    failed_tools: bool = False
    limit: int = 10

    def responses(self, group: ScoredGroup) -> list[int]:
        """The responses of `group` that match (the step aside)."""
        if self.task is not None and task_of(group) != self.task:
            return []
        if self.version is not None and group.policy_version > self.version:
            return []  # every token is at least the group's version
        masks, versions = group.effective_loss_masks, group.effective_token_versions
        errors = group.episode_stat("tool_errors")
        keep = []
        for i, reward in enumerate(float(r) for r in group.rewards):
            if (self.min_reward is not None and reward < self.min_reward) or (
                self.max_reward is not None and reward > self.max_reward
            ):
                continue
            if self.failed_tools and not errors[i]:
                continue
            if self.version is not None and self.version not in versions[i][masks[i] == 1]:
                continue
            keep.append(i)
        return keep


@dataclass(frozen=True)
class StepGroups:
    """The stream groups one learner record consumed: ordinals [`first`, `end`) of the groups in
    commit order (quarantined ones left out). `version`: the policy version it read them at;
    None, with `note` saying why, when that is not known."""

    step: int
    pretrain_step: int | None
    first: int
    end: int
    version: int | None
    note: str = ""


class ConsumedGroups:
    """Which learner record consumed the n-th group of the stream (module docstring)."""

    def __init__(self, records: list[dict[str, Any]], where: str = "the run") -> None:
        self.where = where
        self.ranges: list[StepGroups] = []
        total, previous = 0, None
        for record in records:
            if "stream/consumed_total" not in record:  # a supervised step: no stream
                continue
            end = int(record["stream/consumed_total"])
            self.ranges.append(_step_groups(record, previous, total, end))
            total, previous = max(total, end), record
        self._ends = [r.end for r in self.ranges]

    @classmethod
    def read(cls, run: Location) -> ConsumedGroups:
        return cls(read_metrics(run), run.uri)

    @property
    def consumed(self) -> int:
        """Groups consumed by the last record."""
        return self._ends[-1] if self._ends else 0

    @property
    def last_step(self) -> int | None:
        return self.ranges[-1].step if self.ranges else None

    def at(self, ordinal: int) -> StepGroups | None:
        """The record that consumed group `ordinal`; None: not consumed (as far as recorded)."""
        index = bisect.bisect_right(self._ends, ordinal)
        return self.ranges[index] if index < len(self.ranges) else None

    def step(self, step: int) -> StepGroups:
        """Every group learner step `step` consumed (step 0: value pre-training)."""
        ranges = [r for r in self.ranges if r.step == step]
        if not ranges:
            known = f"steps {self.ranges[0].step}..{self.last_step}" if self.ranges else "none"
            raise SamplesError(
                f"the learner of {self.where} has no record of step {step} (recorded: {known}); "
                "give a recorded step, or leave --step out for the newest samples"
            )
        return replace(ranges[-1], first=ranges[0].first)  # value pre-training: several

    def pending_note(self, ordinal: int) -> str:
        if not self.ranges:
            return (
                f"what the learner did with it is not known: {self.where} has no learner metrics "
                "record with stream/consumed_total yet"
            )
        return (
            f"not consumed yet: group {ordinal + 1} of the stream; the learner's last record "
            f"(step {self.last_step}) had consumed {self.consumed}"
        )


def _step_groups(
    record: dict[str, Any], previous: dict[str, Any] | None, first: int, end: int
) -> StepGroups:
    """The range of `record`, `previous` the record before it: the version it read at is the
    previous step's `policy_version`, or 0 before any step (pre-training publishes nothing)."""
    step, pretrain = int(record.get("step", 0)), record.get("value_pretrain_step")
    before = None if previous is None else int(previous.get("step", 0))
    before_pretrain = previous is not None and "value_pretrain_step" in previous
    if pretrain is not None or (step == 1 and (previous is None or before_pretrain)):
        return StepGroups(step, pretrain, first, end, 0)
    if before == step - 1 and not before_pretrain and "policy_version" in previous:
        return StepGroups(step, None, first, end, int(previous["policy_version"]))
    gap = "nothing" if previous is None else f"step {before}"
    note = (
        f"consumed by step {step} or one before it: the learner's records between {gap} and "
        f"step {step} are missing, so which step and version read it is not known"
    )
    return StepGroups(step, None, first, end, None, note)


@dataclass
class SampleReport:
    """What `read_samples` found: the samples, and how much of the stream it read to find them."""

    samples: list[Sample] = field(default_factory=list)
    groups_read: int = 0
    groups_in_stream: int = 0
    released_before_seq: int = 0


@dataclass(frozen=True)
class _Log:
    """The commit log as read once: each record's first group's ordinal (`bases`)."""

    records: list[CommitRecord]
    bases: list[int]
    total: int
    released: int

    @classmethod
    def read(cls, run: Location, since: _Log | None = None) -> _Log:
        """The log as it is now; with `since` (an earlier read of it), only the records
        committed after it are read."""
        known = since.records if since is not None else []
        records = known + list(read_log(run, start=len(known)))
        skipped = set(quarantined(run))
        bases, total = [], 0
        for record in records:
            bases.append(total)
            if not record.rejected and record.seq not in skipped:
                total += record.num_groups
        return cls(records, bases, total, read_retention(run).released_before_seq)

    def locate(self, ordinal: int) -> Cursor:
        """The cursor of group `ordinal`."""
        seq = bisect.bisect_right(self.bases, ordinal) - 1
        return Cursor(seq, ordinal - self.bases[seq])


def _read(
    reader: StreamReader, log: _Log, start: Cursor, stop: int
) -> Iterator[tuple[int, tuple[int, int], ScoredGroup]]:
    """(ordinal, (seq, offset), group) of every group from `start` up to commit record `stop`."""
    position = start
    while position.seq < stop:
        reader.records_per_round = min(WINDOW, stop - position.seq)
        items = reader.poll(position)
        if not items:
            return
        for after, group in items:
            if not isinstance(group, ScoredGroup):
                continue
            if after.offset:
                seq, offset = after.seq, after.offset - 1
            else:
                seq, offset = after.seq - 1, log.records[after.seq - 1].num_groups - 1
            yield log.bases[seq] + offset, (seq, offset), group
        position = items[-1][0]


def read_samples(
    run: Location, config: RunConfig, decoder: SampleDecoder, wanted: SampleFilter
) -> SampleReport:
    """The samples of `run`'s stream that `wanted` selects (module docstring)."""
    log, steps = _Log.read(run), ConsumedGroups.read(run)
    reader = StreamReader(run, prefetch_rounds=0, write_notes=False)
    report = SampleReport(groups_in_stream=log.total, released_before_seq=log.released)

    def take(
        ordinal: int, position: tuple[int, int], group: ScoredGroup, room: int, newest: bool
    ) -> list[Sample]:
        report.groups_read += 1
        matching = wanted.responses(group)
        chosen = matching[-room:] if newest else matching[:room]
        found = decoder.samples(group, chosen, position) if chosen else []
        return [_with_learner(s, group, ordinal, steps, config) for s in found]

    if wanted.step is not None:
        span = steps.step(wanted.step)
        if span.first >= span.end:
            return report
        start = log.locate(span.first)
        if start.seq < log.released:
            raise SamplesError(
                f"the groups of step {wanted.step} were in segments deleted as consumed "
                f"(storage.stream_retention=consumed released log numbers below {log.released})"
            )
        for ordinal, position, group in _read(reader, log, start, len(log.records)):
            if ordinal >= span.end or len(report.samples) >= wanted.limit:
                break
            room = wanted.limit - len(report.samples)
            report.samples += take(ordinal, position, group, room, newest=False)
        return report

    newest_first: list[list[Sample]] = []
    end = len(log.records)
    while end > log.released:
        begin = max(log.released, end - WINDOW)
        window = log.records[begin:end]
        end = begin
        if wanted.version is not None and all(
            r.rejected or r.min_policy_version > wanted.version for r in window
        ):
            continue
        groups = list(_read(reader, log, Cursor(begin), begin + len(window)))
        for ordinal, position, group in reversed(groups):
            room = wanted.limit - sum(map(len, newest_first))
            if room <= 0:
                break
            if found := take(ordinal, position, group, room, newest=True):
                newest_first.append(found)
        if sum(map(len, newest_first)) >= wanted.limit:
            break
    report.samples = [s for found in reversed(newest_first) for s in found]
    return report


def _with_learner(
    sample: Sample, group: ScoredGroup, ordinal: int, steps: ConsumedGroups, config: RunConfig
) -> Sample:
    span = steps.at(ordinal)
    if span is None:
        return replace(sample, learner_note=steps.pending_note(ordinal))
    if span.version is None:
        return replace(sample, learner_note=span.note)
    return consumed(sample, group, span.step, span.version, config, span.pretrain_step)


def step_samples(
    run: Location, config: RunConfig, decoder: SampleDecoder, step: int, count: int
) -> list[Sample]:
    """The `count` samples the learner's wandb table shows of step `step`
    (`streamrl.learner.samples.batch_samples` of the groups it trained on); none when the
    version it read them at is not known."""
    return StepSampler(run, config, decoder).samples(step, count)


class StepSampler:
    """`step_samples` again and again as a run goes on (the flow's samples artifact): the commit
    log and the learner's records are read incrementally, so each call reads what is new plus
    the step's own segments, however long the run."""

    def __init__(self, run: Location, config: RunConfig, decoder: SampleDecoder) -> None:
        self.run, self.config, self.decoder = run, config, decoder
        self._log: _Log | None = None
        self._metrics = MetricsFollower(run)
        self._records: list[dict[str, Any]] = []  # every one read; `in_order` keeps the last

    def samples(self, step: int, count: int) -> list[Sample]:
        log = self._log = _Log.read(self.run, since=self._log)
        self._records = in_order(self._records + self._metrics.read())
        span = ConsumedGroups(self._records, self.run.uri).step(step)
        if span.version is None or span.first >= span.end:
            return []
        start = log.locate(span.first)
        if start.seq < log.released:
            return []
        config = self.config
        oldest = oldest_usable_version(span.version, config.learner.max_staleness)
        reader, trained = StreamReader(self.run, prefetch_rounds=0, write_notes=False), []
        for ordinal, _, group in _read(reader, log, start, len(log.records)):
            if ordinal >= span.end:
                break
            if drop_reason(group, oldest, config.algorithm.dynamic_sampling) is None:
                trained.append(group)
        versions = [span.version] * len(trained)
        return batch_samples(self.decoder, trained, versions, step, count, config)
