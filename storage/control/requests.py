"""Run-level control records: how a flow, the learner or a user tells running loops what to do.

    <run>/control/STOP               {"reason", "at"}; present = every generator flushes and exits
    <run>/control/stop/<writer>.json  the same for one generator (`gen3`): scaling in
    <run>/control/fleet.json          {"generators", "at"}: how many generators the run should
                                      have (`streamrl scale`), read by the flow placing them

A stop marker is created once and never changed; a new run (or `clear_stop`) starts without the
run's one; a writer's is cleared when its index starts again.

Control files are input from whoever can write the run's storage: a reader checks what it
reads, reports a malformed file (a warning naming the file and the problem) and ignores it,
and never lets it raise into the supervisor that polls it.
"""

from __future__ import annotations

import json
import logging
import time

from storage.fs import Location, put_if_absent

__all__ = [
    "DEFAULT_MAX_GENERATORS",
    "clear_stop",
    "request_stop",
    "requested_generators",
    "set_requested_generators",
    "stop_requested",
]


log = logging.getLogger(__name__)

DEFAULT_MAX_GENERATORS = 64
"""The most generators a fleet request is granted when the caller names no maximum (the
default of `placement.max_generators`)."""

_reported: dict[str, set[str]] = {}  # fleet file -> problems warned about since it last read well


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


def requested_generators(run: Location, maximum: int = DEFAULT_MAX_GENERATORS) -> int | None:
    """The generator count last asked for, at most `maximum` (`placement.max_generators`);
    None when nobody asked, or when `control/fleet.json` is malformed: then a warning names
    the file and the problem (once per problem, however often it is polled) and the request is
    ignored. Storage errors reach the caller."""
    if maximum < 1:
        raise ValueError(f"the generator maximum must be ≥ 1, got {maximum}")
    path = _fleet_path(run)
    try:
        data = run.fs.cat_file(path)
    except FileNotFoundError:
        return None
    count, problem = _parse_fleet(data)
    if count is None:
        _report(run, f"{problem}; the request is ignored (write it with `streamrl scale`)")
        return None
    if count > maximum:
        _report(
            run,
            f"asks for {count} generators, more than placement.max_generators ({maximum}): "
            f"{maximum} are run (raise placement.max_generators to allow more)",
        )
        return maximum
    _reported.pop(path, None)
    return count


def _parse_fleet(data: bytes) -> tuple[int | None, str]:
    """(the count, "") or (None, what is wrong with the file)."""
    try:
        body = json.loads(data)
    except ValueError as exc:  # invalid JSON or not UTF-8
        return None, f"is not JSON ({exc})"
    if not isinstance(body, dict):
        return None, f"is not a JSON object (got {type(body).__name__})"
    if "generators" not in body:
        return None, "has no 'generators' count"
    count = body["generators"]
    if isinstance(count, bool) or not isinstance(count, int):
        return None, f"asks for {count!r} generators, not a whole number"
    if count < 0:
        return None, f"asks for a negative number of generators ({count})"
    return count, ""


def _report(run: Location, problem: str) -> None:
    path = _fleet_path(run)
    seen = _reported.setdefault(path, set())
    if problem not in seen:
        seen.add(problem)
        log.warning("%s/control/fleet.json %s", run.uri, problem)
