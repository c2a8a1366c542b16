"""The evaluation log: one JSON record per evaluated version (`streamrl.evaluation.evaluator`).

Local runs append to `<run>/metrics/eval.jsonl`; object stores cannot append, so there each
record is an object `metrics/eval-v<version>-<ns>.json`. A record holds the metrics,
`version`, `time`, `k`, `temperature`, `dataset` and `held_out`.
"""

from __future__ import annotations

import json
import time
from typing import Any

from storage.fs import Location

__all__ = ["EVAL_LOG", "append_eval_record", "read_eval_records"]

EVAL_LOG = ("metrics", "eval.jsonl")


def append_eval_record(run: Location, record: dict[str, Any]) -> None:
    """Add one record to the run's evaluation log (module docstring)."""
    line = json.dumps(record) + "\n"
    fs = run.fs
    if run.is_local:
        fs.makedirs(run.join("metrics"), exist_ok=True)
        with fs.open(run.join(*EVAL_LOG), "a") as f:
            f.write(line)
    else:  # object stores cannot append: one object per record
        name = f"eval-v{int(record['version']):08d}-{time.time_ns()}.json"
        fs.pipe_file(run.join("metrics", name), line.encode())


def read_eval_records(run: Location) -> list[dict[str, Any]]:
    """Every record of the run's evaluation log, oldest first."""
    fs = run.fs
    if run.is_local:
        path = run.join(*EVAL_LOG)
        texts = [fs.cat_file(path).decode()] if fs.exists(path) else []
    else:
        paths = sorted(fs.glob(run.join("metrics", "eval-v*.json")))
        texts = [blob.decode() for blob in fs.cat(paths).values()] if paths else []
    records = [json.loads(line) for text in texts for line in text.splitlines() if line.strip()]
    return sorted(records, key=lambda r: r.get("time", 0.0))
