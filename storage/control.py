"""Run-level control records: how a flow, the learner or a user tells running loops what to do.

    <run>/control/STOP               {"reason", "at"}; present = every generator flushes and exits
    <run>/control/stop/<writer>.json  the same for one generator (`gen3`): scaling in
    <run>/control/fleet.json          {"generators", "at"}: how many generators the run should
                                      have (`streamrl scale`), read by the flow placing them

A stop marker is created once and never changed; a new run (or `clear_stop`) starts without the
run's one; a writer's is cleared when its index starts again.
"""

from __future__ import annotations

import json
import time

from storage.fs import Location, put_if_absent

__all__ = [
    "clear_stop",
    "request_stop",
    "requested_generators",
    "set_requested_generators",
    "stop_requested",
]


def _stop_path(run: Location, writer: str | None = None) -> str:
    if writer is None:
        return run.join("control", "STOP")
    return run.join("control", "stop", f"{writer}.json")


def request_stop(run: Location, reason: str, *, writer: str | None = None) -> None:
    """Ask every loop of the run (or only generator `writer`) to stop (idempotent: the first
    reason is kept)."""
    payload = json.dumps({"reason": reason, "at": time.time()}).encode()
    path = _stop_path(run, writer)
    if run.is_local:
        run.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    put_if_absent(run.fs, path, payload)


def stop_requested(run: Location, writer: str | None = None) -> bool:
    """Whether the run's stop marker exists, or (with `writer`) that generator's own."""
    if run.fs.exists(_stop_path(run)):
        return True
    return writer is not None and run.fs.exists(_stop_path(run, writer))


def clear_stop(run: Location, *, writer: str | None = None) -> None:
    """Remove the run's stop marker (before resuming a stopped run), or generator `writer`'s
    (before that index runs again)."""
    path = _stop_path(run, writer)
    if run.fs.exists(path):
        run.fs.rm_file(path)


def _fleet_path(run: Location) -> str:
    return run.join("control", "fleet.json")


def set_requested_generators(run: Location, count: int) -> None:
    """Ask for `count` generators (the latest request wins)."""
    if count < 0:
        raise ValueError(f"a run cannot have {count} generators; ask for 0 or more")
    if run.is_local:
        run.fs.makedirs(run.join("control"), exist_ok=True)
    record = {"generators": count, "at": time.time()}
    run.fs.pipe_file(_fleet_path(run), json.dumps(record).encode())


def requested_generators(run: Location) -> int | None:
    """The generator count last asked for, None when nobody asked."""
    try:
        return int(json.loads(run.fs.cat_file(_fleet_path(run)))["generators"])
    except FileNotFoundError:
        return None
