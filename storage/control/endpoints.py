"""Where a served component of the run answers: one small record per name.

    <run>/control/endpoints/<name>.json   {"name", "url", "model", "pid", "host", "started_at"}

A server the run starts (a scorer: `streamrl.scorers.serve`) writes its record once it answers
its health check, and replaces it whenever it starts again (a restart may take another port or
machine); clients read it to find the server, and read it again when it stops answering. Like
every control file it is input from whoever can write the run's storage: `read_endpoint` checks
it (an http(s) URL, the fields and their types) and reports a malformed one as absent, with a
warning naming the problem, so a client keeps waiting rather than calling a wrong address.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from dataclasses import asdict, dataclass

from storage.fs import Location, replace_object

__all__ = ["Endpoint", "clear_endpoint", "read_endpoint", "write_endpoint"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")
_URL = re.compile(r"^https?://[A-Za-z0-9.\-\[\]:]+(/[A-Za-z0-9._~/\-]*)?$")


@dataclass(frozen=True)
class Endpoint:
    """A served component's address: `url` its OpenAI-compatible base URL (…/v1), `model` the
    name it serves its model under, the server's `pid` and `host`, when it became ready."""

    name: str
    url: str
    model: str
    pid: int
    host: str
    started_at: float

    def check(self) -> Endpoint:
        """Raise ValueError naming the first malformed field; return self."""
        if not _NAME.match(self.name):
            raise ValueError(f"name {self.name!r} is not a component name")
        if not _URL.match(self.url):
            raise ValueError(f"url {self.url!r} is not an http(s) base URL")
        if not self.model or not isinstance(self.model, str):
            raise ValueError("model must be a non-empty string")
        if not isinstance(self.pid, int) or self.pid <= 0:
            raise ValueError(f"pid {self.pid!r} must be a positive integer")
        if not isinstance(self.host, str):
            raise ValueError("host must be a string")
        if not isinstance(self.started_at, int | float) or self.started_at <= 0:
            raise ValueError(f"started_at {self.started_at!r} must be a positive time")
        return self


def _path(run: Location, name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"{name!r} is not a component name")
    return run.join("control", "endpoints", f"{name}.json")


def write_endpoint(run: Location, endpoint: Endpoint) -> None:
    """Publish (or replace) `endpoint`'s record."""
    path = _path(run, endpoint.check().name)
    if run.is_local:
        run.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    replace_object(run, path, json.dumps(asdict(endpoint)).encode())


def read_endpoint(run: Location, name: str) -> Endpoint | None:
    """`name`'s record, or None: not published yet, or malformed (logged)."""
    path = _path(run, name)
    try:
        raw = run.fs.cat_file(path)
    except FileNotFoundError:
        return None
    try:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return Endpoint(**data).check()
    except (ValueError, TypeError) as exc:
        log.warning("ignoring the endpoint record %s: %s", path, exc)
        return None


def clear_endpoint(run: Location, name: str, *, only: Endpoint | None = None) -> None:
    """Remove `name`'s record (its server stopped) — with `only`, only while it is still that
    one (a newer server may have replaced it)."""
    path = _path(run, name)
    if only is not None and read_endpoint(run, name) != only:
        return
    with contextlib.suppress(FileNotFoundError):
        run.fs.rm_file(path)
