"""The learner's metrics records as they are read back: `read_metrics(run)` (every record, in
order), `MetricsFollower` (the records written since the last read, for what follows a live
run), `latest_metrics` (the newest, cheap enough to poll) and `read_wandb_link`. Two layouts,
as `streamrl.learner.reporting` writes them: `<run>/metrics/learner.jsonl` on local disk, one
object `<run>/metrics/learner-<step:08d>.json` per record on object stores. A record logged
twice (by a learner killed after logging it, whose resume logs the step again) reads as its
last version; a line cut short is skipped with a warning. Only `storage.fs` below it: the
status, curves and health readers import it without the learner's configuration.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from storage.fs import Location

__all__ = [
    "INITIAL",
    "JSONL",
    "WANDB_RECORD",
    "MetricsFollower",
    "in_order",
    "latest_metrics",
    "read_metrics",
    "read_wandb_link",
]

log = logging.getLogger(__name__)

INITIAL = "initial/"
"""A dataset run's first step records the held-out metrics of the weights it started from as
`initial/<key>` (`streamrl.learner.offline`)."""

JSONL = "learner.jsonl"
WANDB_RECORD = "wandb.json"


def read_metrics(run: Location) -> list[dict[str, Any]]:
    """Every logged learner record in order (value pre-training first, then steps); a record
    logged twice — by a learner killed after logging it — keeps its last version. A line cut
    short by a killed learner is skipped with a warning."""
    return in_order(MetricsFollower(run).read())


class MetricsFollower:
    """Reads a run's learner records as they are written: each `read()` returns the records
    written since the previous call, in the order they were written (local runs: the JSONL from
    the end of the last complete line read, so a line being written waits for the next call;
    object stores: the record objects that are new or were rewritten — a resumed learner logs
    its steps after the checkpoint again — by name)."""

    def __init__(self, run: Location) -> None:
        self.run = run
        self._offset = 0  # bytes of the JSONL read, up to a newline
        self._objects: dict[str, tuple[Any, ...]] = {}  # name → what it was when read

    def read(self) -> list[dict[str, Any]]:
        fs, run = self.run.fs, self.run
        if not fs.exists(run.join("metrics")):
            return []
        lines: list[str] = []
        jsonl = run.join("metrics", JSONL)
        if fs.exists(jsonl):
            size = fs.size(jsonl)
            if size < self._offset:  # written anew (a run recreated at the same place)
                self._offset = 0
            if size > self._offset:
                data = fs.cat_file(jsonl, start=self._offset, end=size)
                complete = data.rfind(b"\n") + 1
                lines += data[:complete].decode(errors="replace").splitlines()
                self._offset += complete
        found = fs.glob(run.join("metrics", "learner-*.json"), detail=True)
        seen = {name: _object_version(info) for name, info in found.items()}
        names = sorted(name for name, version in seen.items() if self._objects.get(name) != version)
        if names:
            blobs = fs.cat(names)
            lines += [blobs[name].decode() for name in sorted(blobs)]
            self._objects.update((name, seen[name]) for name in names)
        return _parse(lines, run)


def _object_version(info: dict[str, Any]) -> tuple[Any, ...]:
    """What tells a rewritten object from the one read before (S3: its ETag; local: mtime)."""
    return (info.get("size"), info.get("ETag"), info.get("LastModified"), info.get("mtime"))


def latest_metrics(run: Location, tail_bytes: int = 256 * 1024) -> dict[str, Any] | None:
    """The newest learner record, reading only the end of the JSONL (or the newest object on
    an object store): cheap enough to poll every few seconds on a long run."""
    fs = run.fs
    if not fs.exists(run.join("metrics")):
        return None
    lines: list[str] = []
    jsonl = run.join("metrics", JSONL)
    if fs.exists(jsonl):
        size = fs.size(jsonl)
        tail = fs.cat_file(jsonl, start=max(0, size - tail_bytes)).decode(errors="replace")
        lines = tail.splitlines()[1:] if size > tail_bytes else tail.splitlines()
    else:  # object names sort by step, then value pre-training step
        names = sorted(fs.glob(run.join("metrics", "learner-*.json")))
        lines = [fs.cat_file(names[-1]).decode()] if names else []
    records = in_order(_parse(lines, run))
    return records[-1] if records else None


def _parse(lines: list[str], run: Location) -> list[dict[str, Any]]:
    records = []
    for line in lines:
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("skipping a partly written metrics line in %s: %.80s", run.uri, line)
    return records


def in_order(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """By (step, value pre-training step); of a record logged twice, the last."""
    latest = {(r.get("step"), r.get("value_pretrain_step")): r for r in records}
    return sorted(
        latest.values(), key=lambda r: (r.get("step", 0), r.get("value_pretrain_step") or 0)
    )


def read_wandb_link(run: Location) -> str | None:
    """The run's wandb link (or, offline, the `wandb sync` command that uploads it), once a
    learner has started wandb; None before that or with wandb disabled."""
    path = run.join("metrics", WANDB_RECORD)
    if not run.fs.exists(path):
        return None
    return json.loads(run.fs.cat_file(path)).get("url")
