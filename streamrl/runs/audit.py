"""An audit of a run from its storage alone: was anything lost or duplicated, and does every
object read back whole? What `streamrl verify RUN` reports (`RunAudit`, `format_audit`).

Checks, each failure one sentence in `RunAudit.problems` naming what is wrong:

* **Commit log** (`storage.stream.log`): gap-free from 0 — a record after a missing log number
  is one no reader ever reaches; no segment committed twice (the same segment name, which
  holds its writer, incarnation and number, at two log numbers; or two names holding the same
  bytes, every object's size and CRC32 alike).
* **Segments**: every committed segment is read and checked by the stream reader's own
  verification (`StreamReader.verify`: sizes, CRC32s, decoding, group counts), with no grace
  for a missing object. A segment the learner quarantined (a note under `stream/quarantine/`
  says why) is reported, not a failure: its loss was seen and explained. One that fails with
  no note is. Segments released as consumed (`storage.stream_retention=consumed`) are not read.
* **Groups**: committed, quarantined, consumed by the learner, trained, dropped stale, dropped
  without signal (dynamic sampling), not consumed yet. The learner's counts must add up
  (consumed = trained + dropped), its checkpoint's stream cursor must stand after exactly the
  groups its counts say it consumed, its metrics at the checkpoint's step must hold the same
  counts, and it cannot have consumed more groups than the stream holds.
* **Lost uncommitted**: segments no commit names that can no longer be committed
  (`storage.stream.sweep.orphan_segments`): a generator that died loses its open segment.
  Expected, and counted, never a failure.
* **Metrics**: one record per step 1..last (`streamrl.runs.metrics_history`: records a resumed
  learner rewrote count once; those of training a resume discarded are counted apart).
* **Checkpoints and weights**: the newest checkpoint passes its checks (or the one a resume
  would use is named); every committed weight version is built and verified by the weight
  store (`WeightStore.build`: manifest, every file's size and checksum, every rebuilt piece);
  LATEST names a committed version; the checkpoint's policy version is committed.

Reads are ordered learner first (metrics, checkpoint), stream log after, as `streamrl status`
does, so on a live run the stream holds at least what the learner reports. An audit of a live
run is a snapshot; `verify` is meant for a stopped or finished run. Nothing is written.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from storage.checkpoints.dcp import CheckpointStore, LearnerState
from storage.control.manifest import open_run
from storage.fs import Location
from storage.stream.log import read_record
from storage.stream.records import CommitRecord, Cursor
from storage.stream.retention import read_retention
from storage.stream.writer import (
    StreamReader,
    min_sweep_grace_s,
    orphan_segments,
    quarantined,
    read_log,
)
from storage.weights.versions import WeightIntegrityError, WeightStore, WeightVersionNotFoundError
from streamrl.runs.metrics_history import COUNTS, MetricsHistory, check_history, metrics_history
from streamrl.runs.metrics_history import ranges as _ranges
from streamrl.runs.status import StreamStatus, read_stream

__all__ = ["RunAudit", "audit_run"]

VERIFY_BATCH = 16  # committed segments fetched and checked per round
_LOG_NAME = re.compile(r"(\d{12})\.json")


@dataclass(frozen=True)
class RunAudit:
    """What `audit_run` found (module docstring). Group figures are None before the learner
    has consumed anything it recorded; `consumed_source` says where they come from.
    `notes`: what is reported but expected (quarantined segments and why, lost open segments,
    released segments, abandoned metrics records). `checkpoint_step`: the checkpoint a resume
    starts from (the newest that passes its checks). The run is whole when `problems` is
    empty."""

    uri: str
    commits: int = 0
    groups_committed: int = 0
    segments_verified: int = 0
    segments_released: int = 0
    segments_quarantined: int = 0
    groups_quarantined: int = 0
    segments_lost_uncommitted: int = 0
    groups_consumed: int | None = None
    groups_trained: int | None = None
    groups_dropped_stale: int | None = None
    groups_dropped_no_signal: int | None = None
    groups_unconsumed: int | None = None
    consumed_source: str = "nothing consumed yet"
    last_step: int = 0
    metrics_records: int = 0
    metrics_rewritten: int = 0
    metrics_abandoned: tuple[int, ...] = ()
    checkpoint_step: int | None = None
    weight_versions: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()

    @property
    def whole(self) -> bool:
        return not self.problems


@dataclass
class _Findings:
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def audit_run(run: Location) -> RunAudit:
    """Audit the run at `run` (module docstring). Raises `StorageError` naming the URI when no
    run is there, and `StorageUnavailableError` when the store does not answer."""
    open_run(run)
    found = _Findings()
    history = metrics_history(run)
    checkpoint_step, checkpoint = _checkpoint(run, found)
    tally = read_stream(run)
    records = list(read_log(run))[: tally.commits]
    _check_log(run, len(records), found)
    _check_duplicates(records, found)
    verified, released = _check_segments(run, records, found)
    lost = orphan_segments(run, min_sweep_grace_s())
    if lost:
        found.notes.append(
            f"{len(lost)} segment(s) were uploaded and never committed (a generator died with "
            f"its segment open), lost as expected: {', '.join(sorted(lost))}"
        )
    figures = _accounting(history, checkpoint_step, checkpoint, tally, found)
    found.problems.extend(check_history(history, checkpoint_step))
    if history.abandoned:
        found.notes.append(
            f"metrics records of step(s) {_ranges(list(history.abandoned))} belong to training "
            "a resume discarded (the learner went back to its checkpoint and has not logged "
            "those steps again)"
        )
    versions = _check_weights(run, checkpoint, found)
    return RunAudit(
        uri=run.uri,
        commits=tally.commits,
        groups_committed=tally.groups,
        segments_verified=verified,
        segments_released=released,
        segments_quarantined=tally.quarantined,
        groups_quarantined=tally.quarantined_groups,
        segments_lost_uncommitted=len(lost),
        **figures,
        last_step=history.last_step,
        metrics_records=len(history.records),
        metrics_rewritten=history.rewritten,
        metrics_abandoned=history.abandoned,
        checkpoint_step=checkpoint_step,
        weight_versions=versions,
        notes=tuple(found.notes),
        problems=tuple(found.problems),
    )


def _checkpoint(run: Location, found: _Findings) -> tuple[int | None, LearnerState | None]:
    """The step and learner state of the checkpoint a resume starts from: the newest that
    passes its checks. Each newer one that fails them is a problem (a resume passes over it)."""
    store = CheckpointStore(run)
    resume = store.latest_verified()
    for step in store.damaged:
        fallback = f"from step {resume}" if resume is not None else "from scratch"
        found.problems.append(
            f"checkpoint step {step} is damaged (a file fails its size or xxh3 check against "
            f"COMMITTED; the error is logged above): a resume passes over it and starts {fallback}"
        )
    return (None, None) if resume is None else (resume, store.read_state(resume))


def _check_log(run: Location, commits: int, found: _Findings) -> None:
    """Records stored after the first missing log number: no reader reaches them."""
    folder = run.child("stream", "log")
    if not folder.fs.exists(folder.path):
        return
    names = (p.rstrip("/").rsplit("/", 1)[-1] for p in folder.fs.ls(folder.path, detail=False))
    after = sorted(int(m[1]) for name in names if (m := _LOG_NAME.fullmatch(name)))
    after = [seq for seq in after if seq > commits]
    if not after:
        return
    stream = run.child("stream")
    stranded = [r for seq in after if (r := read_record(stream, seq)) is not None]
    groups = sum(r.num_groups for r in stranded)
    found.problems.append(
        f"the commit log has no record {commits} but {len(after)} after it (log numbers "
        f"{_ranges(after)}): every reader stops at the gap, so their {groups} groups are never "
        "read"
    )


def _check_duplicates(records: list[CommitRecord], found: _Findings) -> None:
    """A segment committed at two log numbers, or two segments holding the same bytes."""
    by_segment: dict[str, list[int]] = {}
    by_bytes: dict[tuple[tuple[str, tuple[int, int]], ...], list[CommitRecord]] = {}
    for record in records:
        if record.rejected:
            continue
        by_segment.setdefault(record.segment, []).append(record.seq)
        by_bytes.setdefault(tuple(sorted(record.objects.items())), []).append(record)
    for segment, seqs in by_segment.items():
        if len(seqs) > 1:
            found.problems.append(
                f"segment {segment} is committed {len(seqs)} times (log numbers "
                f"{', '.join(map(str, seqs))}): its groups are read once per commit"
            )
    for same in by_bytes.values():
        names = sorted({r.segment for r in same})
        if len(names) > 1:
            where = ", ".join(f"{r.segment} (log {r.seq})" for r in same)
            found.problems.append(
                f"segments {where} hold the same bytes (every object's size and CRC32): the "
                "same groups were committed twice"
            )


def _check_segments(
    run: Location, records: list[CommitRecord], found: _Findings
) -> tuple[int, int]:
    """Read and check every committed segment not released; (verified, released)."""
    released_before = read_retention(run).released_before_seq
    notes = _quarantine_notes(run)
    reader = StreamReader(run, missing_grace_s=0.0, prefetch_rounds=0)
    kept = [r for r in records if r.seq >= released_before]
    failed: dict[int, Exception] = {}
    for start in range(0, len(kept), VERIFY_BATCH):
        failed.update(reader.verify(kept[start : start + VERIFY_BATCH]))
    by_seq = {r.seq: r for r in records}
    for seq, error in sorted(failed.items()):
        record = by_seq[seq]
        what = f"committed segment {record.segment or '(rejected record)'} (log {seq})"
        if seq in notes:
            found.notes.append(f"{what} was quarantined by a reader ({notes[seq]}): {error}")
        else:
            found.problems.append(
                f"{what} fails its checks: {error}; no quarantine note explains it, and its "
                f"{record.num_groups} groups are lost to every reader"
            )
    for seq, reason in sorted(notes.items()):
        if seq not in by_seq:
            found.problems.append(
                f"quarantine note {seq} names no commit record (the log has {len(records)}): "
                f"{reason}"
            )
        elif seq not in failed:
            found.notes.append(
                f"segment {by_seq[seq].segment} (log {seq}) was quarantined by a reader "
                f"({reason}) and reads whole now: its {by_seq[seq].num_groups} groups were "
                "skipped"
            )
    released = min(released_before, len(records))
    if released:
        found.notes.append(
            f"the segments of log numbers below {released} were released as consumed "
            "(storage.stream_retention=consumed): their commit records are counted, their "
            "data is not read"
        )
    return len(kept) - len(failed), released


def _quarantine_notes(run: Location) -> dict[int, str]:
    """Log number → why a reader quarantined it (the note's error, as it wrote it)."""
    folder = run.child("stream", "quarantine")
    reasons = {}
    for seq in quarantined(run):
        try:
            reasons[seq] = str(
                json.loads(folder.fs.cat_file(folder.join(f"{seq:012d}.json")))["error"]
            )
        except (ValueError, KeyError, TypeError) as exc:
            reasons[seq] = f"its note is unreadable: {exc!r}"
    return reasons


def _accounting(
    history: MetricsHistory,
    checkpoint_step: int | None,
    checkpoint: LearnerState | None,
    tally: StreamStatus,
    found: _Findings,
) -> dict[str, Any]:
    """The learner's group figures (from its newest record: metrics, or the checkpoint when
    that is newer), checked against the stream and against each other."""
    saved = None
    if checkpoint is not None and "filter_totals" in checkpoint.extra:
        raw = checkpoint.extra["filter_totals"]
        saved = {name: int(raw.get(name, 0)) for name in COUNTS}
        _check_cursor(checkpoint, saved, tally, found)
        logged = history.at_step(checkpoint.step)
        if logged is not None and all(f"stream/{n}_total" in logged for n in COUNTS):
            differ = [
                f"{name} {saved[name]} vs {round(logged[f'stream/{name}_total'])}"
                for name in COUNTS
                if round(logged[f"stream/{name}_total"]) != saved[name]
            ]
            if differ:
                found.problems.append(
                    f"the checkpoint of step {checkpoint.step} and the learner metrics of that "
                    f"step count different groups ({', '.join(differ)})"
                )
    totals, source = saved, f"checkpoint step {checkpoint_step}"
    last = history.records[-1] if history.records else {}
    newer = checkpoint_step is None or history.last_step >= checkpoint_step
    if newer and all(f"stream/{n}_total" in last for n in COUNTS):
        totals = {name: round(last[f"stream/{name}_total"]) for name in COUNTS}
        source = f"learner metrics, step {history.last_step}"
    if totals is None:
        return {}
    if totals["consumed"] > tally.readable_groups:
        found.problems.append(
            f"the learner consumed {totals['consumed']} groups ({source}), more than the "
            f"{tally.readable_groups} the stream holds outside quarantined segments: groups "
            "were read twice"
        )
    return {
        "groups_consumed": totals["consumed"],
        "groups_trained": totals["accepted"],
        "groups_dropped_stale": totals["dropped_stale"],
        "groups_dropped_no_signal": totals["dropped_zero_var"],
        "groups_unconsumed": tally.readable_groups - totals["consumed"],
        "consumed_source": source,
    }


def _check_cursor(
    checkpoint: LearnerState, saved: dict[str, int], tally: StreamStatus, found: _Findings
) -> None:
    """The checkpoint's counts add up, and its cursor stands after exactly what it counts."""
    where = f"the checkpoint of step {checkpoint.step}"
    dropped = saved["accepted"] + saved["dropped_stale"] + saved["dropped_zero_var"]
    if saved["consumed"] != dropped:
        found.problems.append(
            f"{where} counts {saved['consumed']} groups consumed, but {saved['accepted']} "
            f"trained + {saved['dropped_stale']} dropped stale + {saved['dropped_zero_var']} "
            f"dropped without signal = {dropped}"
        )
    cursor = Cursor.from_dict(checkpoint.stream_cursor) if checkpoint.stream_cursor else Cursor()
    before = tally.groups_before
    segment = before[cursor.seq + 1] - before[cursor.seq] if cursor.seq < tally.commits else 0
    if cursor.seq > tally.commits or cursor.offset > segment:
        found.problems.append(
            f"{where} resumes the stream at {cursor.seq}:{cursor.offset}, beyond the "
            f"{tally.commits} commit records the log holds"
        )
        return
    if (read := tally.groups_at(cursor)) != saved["consumed"]:
        found.problems.append(
            f"{where} counts {saved['consumed']} groups consumed, but its stream cursor "
            f"{cursor.seq}:{cursor.offset} stands after {read} readable groups: groups were "
            "lost or read twice"
        )


def _check_weights(
    run: Location, checkpoint: LearnerState | None, found: _Findings
) -> tuple[int, ...]:
    """Build and verify every committed weight version; the versions that passed."""
    store = WeightStore(run)
    versions, passed, assembled = store.versions(), [], None
    for version in versions:
        try:
            assembled = store.build(version, onto=assembled)
        except WeightVersionNotFoundError as exc:  # a live learner's retention removed it
            found.notes.append(f"weight version {version} went while it was read: {exc}")
            continue
        except WeightIntegrityError as exc:
            found.problems.append(f"weight version {version} does not verify: {exc}")
            continue
        passed.append(version)
    try:
        named = store.read_latest()
    except WeightIntegrityError as exc:
        found.problems.append(str(exc))
        named = None
    if named is not None and named not in versions:
        found.problems.append(
            f"weights/LATEST names version {named}, which has no manifest: generators "
            "following LATEST cannot load it"
        )
    newest = max(versions, default=0)
    if checkpoint is not None and checkpoint.policy_version > newest:
        found.problems.append(
            f"the checkpoint of step {checkpoint.step} records policy version "
            f"{checkpoint.policy_version}, but the newest committed weight version is "
            f"{newest or 'none'}"
        )
    return tuple(passed)
