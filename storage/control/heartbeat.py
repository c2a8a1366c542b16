"""Heartbeats: a long-running process of a run says it still makes progress.

    <run>/control/heartbeats/<name>.json    `Heartbeat`, replaced whole at each beat

A generator beats from its main loop (between engine steps, paused or not), the learner's rank 0
from its step loop and while it waits for data: a process whose loop is stuck (a storage call
that never returns, a stopped process, a deadlock) stops beating, while one that is merely slow or
held back by flow control does not. Whoever supervises the process watches the record change on
its own clock (`streamrl.supervision.liveness`); the wall time inside is for people, never
compared across machines. A beat that cannot be written is skipped: the next one tries again.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields

from storage.fs import Location, replace_object

__all__ = ["Heart", "Heartbeat", "read_heartbeat"]


@dataclass(frozen=True)
class Heartbeat:
    """One beat of process `name` (gen<i>, learner). Invariants: `count` ≥ 1 grows by one
    per beat of the same process (`host`, `pid`); `state` says what it was doing."""

    name: str
    count: int
    host: str
    pid: int
    state: str = ""
    at: float = 0.0  # wall time, for people

    def __post_init__(self) -> None:
        if self.count < 1 or self.pid < 0 or not self.name:
            raise ValueError(f"heartbeat of {self.name!r}: count ≥ 1, pid ≥ 0, a name")

    @property
    def beat(self) -> tuple[str, int, int]:
        """What identifies this beat: a new one differs from every earlier one."""
        return self.host, self.pid, self.count

    @classmethod
    def from_json(cls, data: bytes) -> Heartbeat:
        """Fields a newer writer added are left out: a beat is a beat."""
        try:
            known = {f.name for f in fields(cls)}
            return cls(**{k: v for k, v in json.loads(data).items() if k in known})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"heartbeat record is unreadable: {exc}") from None


def _path(run: Location, name: str) -> str:
    return run.join("control", "heartbeats", f"{name}.json")


def read_heartbeat(run: Location, name: str) -> Heartbeat | None:
    """The last beat of `name`, or None before its first."""
    try:
        return Heartbeat.from_json(run.fs.cat_file(_path(run, name)))
    except FileNotFoundError:
        return None


@dataclass
class Heart:
    """Beats for process `name` at most every `every_s` (`beat(state)`, called from the loop
    whose progress it stands for; `meanwhile(state)` around one long, bounded piece of work of
    that loop, such as loading a weight version). Safe from several threads."""

    run: Location
    name: str
    every_s: float = 10.0
    count: int = 0
    _next: float = field(default=0.0, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def beat(self, state: str = "") -> None:
        with self._lock:
            now = time.monotonic()
            if now < self._next:
                return
            self._next = now + self.every_s
            self.count += 1
            record = Heartbeat(
                self.name, self.count, socket.gethostname(), os.getpid(), state, time.time()
            )
            try:
                data = json.dumps(asdict(record)).encode()
                replace_object(self.run, _path(self.run, self.name), data)
            except Exception:  # storage down: this beat is missed, and the watcher sees that
                self._next = now  # try again at the next call

    @contextlib.contextmanager
    def meanwhile(self, state: str) -> Iterator[None]:
        """Beat from a thread while the block runs: work the loop cannot beat during, which
        ends by itself (its storage calls time out)."""
        done = threading.Event()

        def beating() -> None:
            while not done.wait(self.every_s / 2):
                self.beat(state)

        thread = threading.Thread(target=beating, daemon=True, name=f"heart-{self.name}")
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
