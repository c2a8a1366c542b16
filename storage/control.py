"""Run-level control markers: how a flow, the learner or a user tells running loops to stop.

    <run>/control/STOP    {"reason": ..., "at": ...}; present = every generator flushes and exits

A marker is created once and never changed; a new run (or `clear_stop`) starts without one.
"""

from __future__ import annotations

import json
import time

from storage.fs import Location, put_if_absent

__all__ = ["clear_stop", "request_stop", "stop_requested"]


def _stop_path(run: Location) -> str:
    return run.join("control", "STOP")


def request_stop(run: Location, reason: str) -> None:
    """Ask every loop of the run to stop (idempotent: the first reason is kept)."""
    payload = json.dumps({"reason": reason, "at": time.time()}).encode()
    if run.is_local:
        run.fs.makedirs(run.join("control"), exist_ok=True)
    put_if_absent(run.fs, _stop_path(run), payload)


def stop_requested(run: Location) -> bool:
    """Whether a stop marker exists (one cheap existence check)."""
    return run.fs.exists(_stop_path(run))


def clear_stop(run: Location) -> None:
    """Remove the stop marker, e.g. before resuming a stopped run."""
    if run.fs.exists(_stop_path(run)):
        run.fs.rm_file(_stop_path(run))
