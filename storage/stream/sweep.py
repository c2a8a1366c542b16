"""Removing orphan segments: uploaded, never committed (their writer died), never read.

The rule that keeps the sweeper from removing a segment that can still be committed:

* A writer never commits a segment whose upload began `commit_deadline_s` or more ago (its own
  monotonic clock); past the deadline it uploads the same bytes again under a fresh segment
  name and commits that one (`StreamWriter.commit`), so no data is lost.
* The sweeper fixes `now` *before* it reads the log, removes only segments that the log does
  not name and whose newest object is at least `grace_s` older than `now`, and refuses a
  grace shorter than `min_sweep_grace_s()`: the deadline plus `margin_s`.

Why that is safe: a segment's upload began before its newest object was written, so a segment
the sweeper removes began uploading more than `grace_s - skew` before `now`. Its writer could
send the commit only until `commit_deadline_s` after that, so the commit, if any, landed
before `now - grace_s + skew + commit_deadline_s + latency` ≤ `now`, when the margin covers
the clock skew between the sweeper and the store, the store's mtime resolution (1 s on S3) and
one commit request's latency. It would then have been in the log the sweeper read after `now`:
a segment the sweeper removes is not committed and can no longer be.

A writer killed between creating a local segment's folders and writing its first object
leaves a folder with no object: it is swept by the newest mtime of its folders. (S3 has no
empty folders; a prefix some servers list for a while after its objects were deleted is left
alone.)
"""

from __future__ import annotations

import time
from datetime import datetime

from storage.fs import Location
from storage.stream.log import read_log

__all__ = [
    "COMMIT_DEADLINE_S",
    "SWEEP_MARGIN_S",
    "SweepGraceError",
    "min_sweep_grace_s",
    "orphan_segments",
    "sweep_orphans",
]

COMMIT_DEADLINE_S = 300.0
"""A writer commits a segment only within this many seconds of the start of its upload."""

SWEEP_MARGIN_S = 300.0
"""Added to the commit deadline for the shortest grace the sweeper accepts: clock skew between
machines and the store, mtime resolution and the latency of the commit request itself."""


class SweepGraceError(ValueError):
    """The sweep grace is too short to be safe; the message names the minimum."""


def min_sweep_grace_s(
    commit_deadline_s: float = COMMIT_DEADLINE_S, margin_s: float = SWEEP_MARGIN_S
) -> float:
    """The shortest grace with which sweeping cannot remove a segment that can be committed."""
    return commit_deadline_s + margin_s


def _modified(info: dict) -> float:
    value = info.get("mtime", info.get("LastModified", info.get("created")))
    if isinstance(value, datetime):
        return value.timestamp()
    return float(value or 0.0)


def _last_written(segments: Location, path: str) -> float | None:
    """When the newest object of the segment folder `path` was written; for a local folder
    with no object, when its newest sub-folder was made; None for an S3 prefix with no object
    (some servers list an emptied folder for a while after): nothing to remove."""
    fs = segments.fs
    infos = list(fs.find(path, withdirs=segments.is_local, detail=True).values())
    objects = [i for i in infos if i["type"] == "file"]
    if not objects and segments.is_local:  # folders are real locally: they tell their age
        objects = [fs.info(path), *infos]
    return max((_modified(i) for i in objects), default=None)


def orphan_segments(
    run: Location,
    grace_s: float,
    *,
    now: float | None = None,
    commit_deadline_s: float = COMMIT_DEADLINE_S,
    margin_s: float = SWEEP_MARGIN_S,
) -> list[str]:
    """Segment folders that no commit record names and that have not changed for `grace_s`.

    Only folders listed under `stream/segments/` are candidates: no path a commit record names
    is ever removed (a rejected record, `storage.stream.records.CommitRecord`, names none).

    `commit_deadline_s` must be the writers' (`StreamWriter(commit_deadline_s=...)`).
    Raises `SweepGraceError` for a grace shorter than
    `min_sweep_grace_s(commit_deadline_s, margin_s)`.
    """
    minimum = min_sweep_grace_s(commit_deadline_s, margin_s)
    if grace_s < minimum:
        raise SweepGraceError(
            f"sweep grace {grace_s:g}s is shorter than the writers' commit deadline "
            f"({commit_deadline_s:g}s) plus a {margin_s:g}s margin for clock skew: segments "
            f"still being committed could be removed; use a grace of at least {minimum:g}s"
        )
    now = time.time() if now is None else now  # before reading the log: see the module rule
    stream = run.child("stream")
    segments = stream.child("segments")
    if not segments.fs.exists(segments.path):
        return []
    committed = {r.segment for r in read_log(run) if not r.rejected}
    orphans = []
    for path in segments.fs.ls(segments.path, detail=False):
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if name in committed:
            continue
        written = _last_written(segments, path)
        if written is not None and now - written >= grace_s:
            orphans.append(name)
    return orphans


def sweep_orphans(
    run: Location,
    grace_s: float,
    *,
    now: float | None = None,
    commit_deadline_s: float = COMMIT_DEADLINE_S,
    margin_s: float = SWEEP_MARGIN_S,
) -> list[str]:
    """Delete the `orphan_segments`; returns the names removed."""
    segments = run.child("stream", "segments")
    removed = orphan_segments(
        run, grace_s, now=now, commit_deadline_s=commit_deadline_s, margin_s=margin_s
    )
    for name in removed:
        segments.fs.rm(segments.join(name), recursive=True)
    return removed
