"""Reading the learner's metrics back from a run (placeholder until the reporter lands)."""

from __future__ import annotations

import json
from typing import Any

from storage.fs import Location

__all__ = ["read_metrics"]


def read_metrics(run: Location) -> list[dict[str, Any]]:
    """Every logged learner step, sorted by step; a step logged twice keeps the last line."""
    folder = run.join("metrics")
    fs = run.fs
    if not fs.exists(folder):
        return []
    lines: list[str] = []
    jsonl = run.join("metrics", "learner.jsonl")
    if fs.exists(jsonl):
        lines += fs.cat_file(jsonl).decode().splitlines()
    for path in sorted(fs.glob(run.join("metrics", "learner-*.json"))):
        lines.append(fs.cat_file(path).decode())
    by_step: dict[tuple[Any, Any], dict[str, Any]] = {}
    for line in lines:
        if line.strip():
            record = json.loads(line)
            by_step[(record.get("step"), record.get("value_pretrain_step"))] = record
    return sorted(
        by_step.values(), key=lambda r: (r.get("step", 0), r.get("value_pretrain_step") or 0)
    )
