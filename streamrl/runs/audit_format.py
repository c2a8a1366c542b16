"""A run's audit (`streamrl.runs.audit.RunAudit`) as text: the console report `streamrl verify`
prints, and the one-line JSON object of `streamrl verify --json`. Pure functions of the record:
nothing here reads storage."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict

from streamrl.runs.audit import RunAudit
from streamrl.runs.metrics_history import ranges

__all__ = ["audit_json", "format_audit"]


def audit_json(audit: RunAudit) -> str:
    """The audit as one line of JSON, with `whole` added."""
    return json.dumps({**asdict(audit), "whole": audit.whole}, allow_nan=False)


def format_audit(audit: RunAudit) -> str:
    """The audit as a compact report: figures, notes, then every problem."""
    return "\n".join(f"{label:<11}{text}".rstrip() for label, text in _rows(audit))


def _rows(a: RunAudit) -> Iterator[tuple[str, str]]:
    yield "run", a.uri
    verdict = "whole" if a.whole else f"NOT whole: {_plural(len(a.problems), 'problem')}"
    yield "verdict", verdict
    yield "stream", f"{a.commits} commits, {a.groups_committed} groups committed"
    checked = f"{_plural(a.segments_verified, 'segment')} read whole (sizes, CRC32s, decoding)"
    if a.segments_released:
        checked += f"; {a.segments_released} released as consumed, not read"
    yield "", checked
    if a.segments_quarantined:
        yield (
            "",
            (
                f"quarantined: {_plural(a.segments_quarantined, 'segment')} "
                f"({a.groups_quarantined} groups)"
            ),
        )
    yield "", f"lost uncommitted: {_plural(a.segments_lost_uncommitted, 'open segment')}"
    if a.groups_consumed is None:
        yield "groups", "none consumed yet (no checkpoint or learner step)"
    else:
        yield (
            "groups",
            (
                f"consumed {a.groups_consumed} = trained {a.groups_trained} + dropped stale "
                f"{a.groups_dropped_stale} + dropped without signal {a.groups_dropped_no_signal} "
                f"({a.consumed_source})"
            ),
        )
        yield "", f"not consumed yet: {a.groups_unconsumed}"
    metrics = f"{_plural(a.metrics_records, 'record')}, steps up to {a.last_step}"
    if a.metrics_rewritten:
        metrics += f"; {a.metrics_rewritten} rewritten by resumed learners"
    if a.metrics_abandoned:
        metrics += f"; abandoned steps {ranges(list(a.metrics_abandoned))}"
    yield "metrics", metrics
    checkpoint = "none" if a.checkpoint_step is None else f"step {a.checkpoint_step}"
    yield "checkpoint", checkpoint
    versions = ranges(list(a.weight_versions)) if a.weight_versions else "none"
    yield "weights", f"verified versions: {versions}"
    for i, note in enumerate(a.notes):
        yield "notes" if i == 0 else "", f"- {note}"
    for i, problem in enumerate(a.problems):
        yield "problems" if i == 0 else "", f"- {problem}"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"
