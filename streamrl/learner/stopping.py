"""A learner's stop from outside: SIGTERM or Ctrl-C to whichever rank gets it (`Stopping`).

The signal sets `event` on the rank it reaches (`streamrl.isolation.lifetime.stop_on_sigterm`):
all of them when a supervisor stops the run, one alone when a user signals one rank. A rank
other than 0 tells rank 0 through the job's store (`Topology.raise_flag`), since rank 0 decides
for every rank (`Topology.decide_on_main(stopping.requested)`) — between steps, and while it
alone waits for data and the others wait in a collective. From the moment a rank notices,
`learner.stop_grace_s` counts (`deadline`): the step in hand finishes, and a checkpoint of it is
committed if it fits in what is left (`streamrl.learner.loop.Learner`).
"""

from __future__ import annotations

import logging
import threading
import time

from streamrl.learner.topology import Topology

__all__ = ["Stopping"]

log = logging.getLogger("streamrl.learner.loop")  # with the learner's other lines about a stop


class Stopping:
    """One rank's view of a stop: `event` (set by a signal, or by rank 0 when another rank was
    signalled), `deadline` (monotonic: when it was noticed + the grace; None before), `close()`
    once the learner is done (ends the thread that notices)."""

    def __init__(self, event: threading.Event, topology: Topology, grace_s: float) -> None:
        self.event, self.topology, self.grace_s = event, topology, grace_s
        self.deadline: float | None = None
        self._closed = threading.Event()
        threading.Thread(target=self._notice, daemon=True, name="stop-deadline").start()

    def requested(self) -> bool:
        """Rank 0: whether any rank was stopped (its own signal, or another rank's flag)."""
        if not self.event.is_set() and self.topology.flag_raised("stop"):
            self.event.set()  # the grace counts from now
        return self.event.is_set()

    def close(self) -> None:
        self._closed.set()

    def _notice(self) -> None:
        """When this rank is stopped: the grace starts; a rank other than 0 tells rank 0."""
        while not self.event.wait(timeout=1.0):
            if self._closed.is_set():
                return
        self.deadline = time.monotonic() + self.grace_s
        if not self.topology.is_main:
            self.topology.raise_flag("stop")
        elif not self._closed.is_set():
            log.warning(
                "stopping (SIGTERM or Ctrl-C): the step in hand finishes, then a checkpoint "
                "of it, within learner.stop_grace_s=%g s", self.grace_s,
            )  # fmt: skip
