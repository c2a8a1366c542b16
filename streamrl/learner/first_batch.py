"""What the learner says while it waits for the groups of its first step.

Before that step the terminal shows nothing of the learner (its step lines come after it), and
on a loaded machine the generators may take minutes to commit enough groups. `FirstBatchWait`
logs a progress line on the logger `streamrl.progress`, which the terminal shows
(`streamrl.supervision.output.PROGRESS_LOGGER`): the first after `FIRST_NOTICE_S` of waiting,
then each time the wait has doubled (30, 60, 120, 240 s ...), so a start of minutes shows a few
lines, never one per poll of the stream. Once the first batch is collected it says nothing more:
later waits show in the step lines and the health checks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["FIRST_NOTICE_S", "FirstBatchWait"]

FIRST_NOTICE_S = 30.0  # a wait shorter than this says nothing
progress_log = logging.getLogger("streamrl.progress")


class FirstBatchWait:
    """The learner's wait for the `batch_groups` groups of step `step` (the first of this
    process). `waiting(accepted)` is called on every idle poll of the stream (from the reader's
    thread) with the groups accepted so far; `collected()` once the batch is complete. The wait
    is timed from the first `waiting` call: the learner's own start-up is not counted."""

    def __init__(
        self,
        batch_groups: int,
        step: int,
        *,
        first_after_s: float = FIRST_NOTICE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.batch_groups, self.step = batch_groups, step
        self._clock = clock
        self._started: float | None = None
        self._next_s = first_after_s  # the wait, in seconds, at which the next line is due
        self._collected = False

    def waiting(self, accepted: int) -> None:
        if self._collected:
            return
        now = self._clock()
        if self._started is None:
            self._started = now
        waited = now - self._started
        if waited < self._next_s:
            return
        progress_log.info(
            "waiting for the groups of step %d: %d of %d after %.0f s",
            self.step, accepted, self.batch_groups, waited,
        )  # fmt: skip
        self._next_s = 2 * waited

    def collected(self) -> None:
        self._collected = True
