"""What a run's processes print: each line appended to the component's log file
(`ComponentLogs`), and the few a user's terminal shows (`noteworthy`).

Used by every supervisor of processes (`streamrl.supervision.supervisor`) and by the flows that run
one.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import IO

from storage.fs import Location

__all__ = ["RESTART_NOTICE", "ComponentLogs", "noteworthy"]

# What a user's terminal shows of a component's output: the learner's step lines, streamrl's
# warnings and errors (as logged by `streamrl.cli.main`: "<date> <time> LEVEL logger: message"). The
# rest (engine start-up, progress bars, third-party warnings) goes to the log files only.
_OWN_LINE = re.compile(
    r"^\S+ \S+ (?P<level>INFO|WARNING|ERROR|CRITICAL) (?:streamrl|storage|flows)\.\S+: "
    r"(?P<message>.*)$"
)
RESTART_NOTICE = "exited with code"  # a supervisor's notice, passed on with the lines
_STEP = re.compile(r"^step \d+(/\d+)?:")


def noteworthy(line: str) -> str | None:
    """What a terminal shows of a component's output `line`: the learner's step line or one of
    streamrl's warnings or errors, without the timestamp and logger, and the supervisor's
    restart notices; None for the rest."""
    if line.startswith(RESTART_NOTICE):  # the supervisor's own notice of a restart
        return f"WARNING: {line}"
    own = _OWN_LINE.match(line)
    if own is None:
        return None
    level, message = own["level"], own["message"]
    if level == "INFO":
        return message if _STEP.match(message) else None
    return f"{level}: {message}"


class ComponentLogs:
    """Each component's output, appended line by line to `<folder>/<component>.log`."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._files: dict[str, IO[str]] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_run(cls, run: Location) -> ComponentLogs:
        """`<run>/logs/` for a run on local disk, else `./streamrl-logs/<run name>/`."""
        if run.is_local:
            return cls(Path(run.path) / "logs")
        return cls(Path("streamrl-logs") / run.path.rstrip("/").rsplit("/", 1)[-1])

    def write(self, component: str, line: str) -> None:
        with self._lock:
            if component not in self._files:
                self.folder.mkdir(parents=True, exist_ok=True)
                self._files[component] = open(  # noqa: SIM115 (closed by close())
                    self.folder / f"{component}.log", "a", buffering=1
                )
            self._files[component].write(line + "\n")

    def close(self) -> None:
        with self._lock:
            for file in self._files.values():
                file.close()
            self._files.clear()
