"""Liveness: a process of a run that stopped making progress is noticed and restarted.

A generator or a learner that hangs — a storage connection stuck on an address that no longer
exists, a process stopped (SIGSTOP), a deadlock — neither exits nor fails: without a watch it
holds its index (or the run) forever while the run starves. Each beats from its loop
(`storage.control.heartbeat`); `LivenessWatch` tells a supervisor (this machine's
`Supervisor`, the work pools' `PoolSupervisor`) when one has not beaten for too long:

- after its first beat, `placement.liveness_timeout_s` (the learner:
  `placement.learner_liveness_timeout_s`, longer than a step and a checkpoint);
- before it (a starting process loads its model, an engine compiles), `placement.startup_timeout_s`.

The clock is the supervisor's own (`time.monotonic`): a beat counts when the record changes, so
clocks of other machines never matter. A record that cannot be read says nothing either way: the
wait starts over.
The supervisor then ends the process as a failure — the reason logged, the restart counted
against the component's budget as any crash is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from storage.control.heartbeat import read_heartbeat
from storage.fs import Location
from streamrl.placement.config import Liveness

__all__ = ["LivenessWatch", "Watched"]

log = logging.getLogger(__name__)


@dataclass
class Watched:
    """One process under watch: when it started and when its record last changed."""

    timeout_s: float
    startup_s: float
    started: float
    last_beat: tuple[str, int, int] | None
    changed: float | None = None  # None: no beat of this process yet


class LivenessWatch:
    """The heartbeats of a run's processes, watched on this supervisor's clock."""

    def __init__(
        self,
        run: Location,
        placement: Liveness,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.run, self.placement, self.clock = run, placement, clock
        self.watched: dict[str, Watched] = {}

    def started(self, name: str, kind: str) -> None:
        """A new process of `name` (a learner or generator) started now: the beat on record
        (an earlier process's) is where it starts from."""
        timeout = self.placement.liveness_timeout_s
        if kind == "learner":
            timeout = self.placement.learner_liveness_timeout_s
        try:
            beat = self._beat(name)
        except Exception as exc:  # unreadable: the first beat read counts as its own
            log.debug("heartbeat of %s unreadable: %r", name, exc)
            beat = None
        self.watched[name] = Watched(timeout, self.placement.startup_timeout_s, self.clock(), beat)

    def stalled(self, name: str) -> str | None:
        """Why `name` counts as hung now ("no heartbeat for 312 s (…)"), or None."""
        watched = self.watched.get(name)
        if watched is None:
            return None
        now = self.clock()
        try:
            beat = self._beat(name)
        except Exception as exc:  # unreadable now: it says nothing, and the wait starts over
            log.debug("heartbeat of %s unreadable: %r", name, exc)
            if watched.changed is None:
                watched.started = now
            else:
                watched.changed = now
            return None
        if beat is not None and beat != watched.last_beat:
            watched.last_beat, watched.changed = beat, now
            return None
        if watched.changed is None:
            if now - watched.started < watched.startup_s:
                return None
            return (
                f"no heartbeat {now - watched.started:.0f} s after it started "
                f"(placement.startup_timeout_s={watched.startup_s:g})"
            )
        if now - watched.changed < watched.timeout_s:
            return None
        knob = "learner_liveness_timeout_s" if name.startswith("learner") else "liveness_timeout_s"
        return (
            f"no heartbeat for {now - watched.changed:.0f} s: its loop is stuck "
            f"(placement.{knob}={watched.timeout_s:g})"
        )

    def forget(self, name: str) -> None:
        self.watched.pop(name, None)

    def _beat(self, name: str) -> tuple[str, int, int] | None:
        record = read_heartbeat(self.run, name)
        return None if record is None else record.beat
