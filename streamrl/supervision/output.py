"""What a run's processes print: each line appended to the component's log file
(`ComponentLogs`; for a run on object storage also copied there), and the few a user's terminal
shows (`noteworthy`): the learner's step lines, streamrl's warnings and errors, and the progress
a component reports before the first step (INFO records of the logger `streamrl.progress`, a few
per component: an engine up, the first groups committed, a learner still waiting for groups).

Used by every supervisor of processes (`streamrl.supervision.supervisor`) and by the flows that run
one.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
from pathlib import Path
from typing import IO

from storage.fs import Location
from streamrl.isolation.terminal import printable

__all__ = [
    "LOG_COPY_EVERY_S",
    "PROGRESS_LOGGER",
    "RESTART_NOTICE",
    "STEP_LINE",
    "ComponentLogs",
    "noteworthy",
]

log = logging.getLogger(__name__)
LOG_COPY_EVERY_S = 30.0  # how often a run on object storage gets its components' logs copied

# What a user's terminal shows of a component's output: the learner's step lines, the progress
# lines, streamrl's warnings and errors (as logged by `streamrl.cli.main`: "<date> <time> LEVEL
# logger: message"). The rest (engine start-up, progress bars, third-party warnings) goes to the
# log files only.
_OWN_LINE = re.compile(
    r"^\S+ \S+ (?P<level>INFO|WARNING|ERROR|CRITICAL) "
    r"(?P<logger>(?:streamrl|storage|flows)\.\S+): (?P<message>.*)$"
)
RESTART_NOTICE = "exited with code"  # a supervisor's notice, passed on with the lines
STEP_LINE = re.compile(r"^step \d+(/\d+)?:")
PROGRESS_LOGGER = "streamrl.progress"
"""The logger whose INFO records a terminal shows: what a component reports before the first
step, each at most a few times (the components below this layer name it by its string)."""


def noteworthy(line: str) -> str | None:
    """What a terminal shows of a component's output `line`: the learner's step line, a progress
    line (`PROGRESS_LOGGER`) or one of streamrl's warnings or errors, without the timestamp and
    logger, and the supervisor's restart notices; None for the rest."""
    line = printable(line)  # a warning may quote what the model wrote
    if line.startswith(RESTART_NOTICE):  # the supervisor's own notice of a restart
        return f"WARNING: {line}"
    own = _OWN_LINE.match(line)
    if own is None:
        return None
    level, message = own["level"], own["message"]
    if level == "INFO":
        shown = STEP_LINE.match(message) or own["logger"] == PROGRESS_LOGGER
        return message if shown else None
    return f"{level}: {message}"


class ComponentLogs:
    """Each component's output, appended line by line to `<folder>/<component>.log`; with
    `copy_to` (a folder of the run's storage) each file is also copied there every
    `copy_every_s` while it grows, and when the logs close: a container's or a pod's files go
    with it, the run's storage stays. A copy that fails (storage unreachable) is retried at the
    next one; it never stops the component."""

    def __init__(
        self,
        folder: Path,
        copy_to: tuple[Location, str] | None = None,
        copy_every_s: float = LOG_COPY_EVERY_S,
    ) -> None:
        self.folder = folder
        self._files: dict[str, IO[str]] = {}
        self._lock = threading.Lock()
        self._copy_to = copy_to
        self._copy_every_s = copy_every_s
        self._copied: dict[str, int] = {}  # component: the size of its last copy
        self._closed = threading.Event()
        self._copier: threading.Thread | None = None

    @classmethod
    def for_run(cls, run: Location) -> ComponentLogs:
        """`<run>/logs/` for a run on local disk; else `./streamrl-logs/<run name>/`, copied to
        `<run>/logs/<host name>/`."""
        if run.is_local:
            return cls(Path(run.path) / "logs")
        folder = Path("streamrl-logs") / run.path.rstrip("/").rsplit("/", 1)[-1]
        return cls(folder, copy_to=(run, run.join("logs", socket.gethostname())))

    def write(self, component: str, line: str) -> None:
        with self._lock:
            if component not in self._files:
                self.folder.mkdir(parents=True, exist_ok=True)
                self._files[component] = open(  # noqa: SIM115 (closed by close())
                    self.folder / f"{component}.log", "a", buffering=1
                )
                if self._copy_to is not None and self._copier is None:
                    self._copier = threading.Thread(
                        target=self._copy_while_open, name="log-copy", daemon=True
                    )
                    self._copier.start()
            self._files[component].write(line + "\n")

    def close(self) -> None:
        with self._lock:
            for file in self._files.values():
                file.close()
            components = list(self._files)
            self._files.clear()
        self._closed.set()
        if self._copier is not None:
            self._copier.join()
            self._copier = None
        self._copy(components)

    def _copy_while_open(self) -> None:
        while not self._closed.wait(self._copy_every_s):
            with self._lock:
                components = list(self._files)
            self._copy(components)

    def _copy(self, components: list[str]) -> None:
        if self._copy_to is None:
            return
        run, folder = self._copy_to
        for component in components:
            path = self.folder / f"{component}.log"
            try:
                size = path.stat().st_size
                if self._copied.get(component) != size:
                    run.fs.makedirs(folder, exist_ok=True)  # local disk; nothing on S3
                    run.fs.put_file(str(path), f"{folder}/{component}.log")
                    self._copied[component] = size
            except Exception as exc:  # storage down: the next copy tries again
                log.debug("could not copy %s to %s/: %s", path, folder, exc)
