"""A run's health warnings, read from its storage: what `streamrl status` shows under "health"
and what a supervisor can put in its own log, so a warning a learner logged reaches whoever
watches the run, not only the learner's log.

Two sources:

* The learner's progress record (`control/learner.json`, `LearnerProgress.no_signal_*`): a
  learner that dynamic sampling starves — `STARVED_BATCHES` batches' worth of groups in a row
  with no signal, all correct or all wrong — is stuck inside a step that cannot finish, so no
  metrics record can say so. Shown while the record says so (a learner that is gone leaves its
  last record: why it never trained stays visible).
* The learner's metrics records: each health condition (`streamrl.learner.health`) is recorded
  in the `health` list of the step where it became true. Conditions are edge-triggered and
  their clearing is not recorded, so the newest firing of each condition is shown, its message
  naming the step; a condition fired in training that a resume discarded (a record of a step
  at or after a step logged again later) is dropped.

`HealthWatch` keeps them up to date from storage, reading only the metrics logged since its
last read; `health_warnings(run)` is one read.
"""

from __future__ import annotations

from typing import Any

from storage.fs import Location
from storage.stream.learner_progress import LearnerProgress, read_learner_progress
from streamrl.config.stored import read_current_config
from streamrl.learner.batching import is_starved, starvation_warning
from streamrl.learner.metrics_records import MetricsFollower

__all__ = ["HealthWatch", "health_warnings", "starvation"]


def health_warnings(run: Location) -> list[str]:
    """The run's health warnings now, one sentence each (module docstring): a starved learner
    first, then the newest firing of each health condition in step order."""
    return HealthWatch(run).read()


def starvation(progress: LearnerProgress | None, batch_groups: int) -> str | None:
    """The warning of a learner whose progress record shows it starved by dynamic sampling,
    for a batch of `batch_groups` groups; None when it is not."""
    if progress is None:
        return None
    correct, wrong = progress.no_signal_correct, progress.no_signal_wrong
    if not is_starved(correct + wrong, batch_groups):
        return None
    return f"health: starved at step {progress.step + 1}: {starvation_warning(correct, wrong)}"


class HealthWatch:
    """The health warnings of the run at `run`, kept up to date: each `read()` takes the
    metrics records logged since the last one and the learner's progress record as it is now."""

    def __init__(self, run: Location) -> None:
        self.run = run
        self._follower = MetricsFollower(run)
        self._fired: dict[str, tuple[int, str]] = {}  # condition → (step, message)
        self._batch_groups: int | None = None

    def read(self) -> list[str]:
        for record in self._follower.read():
            self._add(record)
        warnings = [message for _, message in sorted(self._fired.values())]
        starved = self._starvation()
        return [starved, *warnings] if starved else warnings

    def _add(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if not isinstance(step, int) or "value_pretrain_step" in record:
            return
        self._fired = {c: fired for c, fired in self._fired.items() if fired[0] < step}
        for event in record.get("health") or ():
            if isinstance(event, dict) and "condition" in event:
                message = str(event.get("message") or f"health: {event['condition']}")
                self._fired[str(event["condition"])] = (step, message)

    def _starvation(self) -> str | None:
        try:
            progress = read_learner_progress(self.run)
        except ValueError as exc:  # advisory: the learner rewrites it after its next step
            return f"health: the learner's progress record is unreadable ({exc})"
        if progress is None:
            return None
        if self._batch_groups is None:
            self._batch_groups = int(read_current_config(self.run)["learner"]["batch_groups"])
        return starvation(progress, self._batch_groups)
