"""The supervision core: one run's processes on this machine, kept running until the run is
done — for `streamrl run`, the `streamrl` and `generator` Prefect flows and `make demo` alike.

`Supervisor.for_run` places the learner, the generators and the evaluator
(`streamrl.placement`); `keep_running(component)` runs one to its end (`streamrl.launch
.run_process`), restarting it after a crash (the learner resumes from its checkpoint, a
generator continues its prompts) until its restarts are spent; the learner's success lets the
others finish; a component that failed for good, Ctrl-C or SIGTERM stops everything (`abort`).
Each output line goes to the component's log file (`ComponentLogs`); `noteworthy(line)` picks
what a terminal shows. `run()` supervises on threads (`streamrl run`); the flows run
`keep_running` as Prefect tasks (`flows.components`).
"""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from storage.control import request_stop, stop_requested
from storage.fs import Location
from streamrl.config import RunConfig
from streamrl.launch import (
    evaluator_command,
    generator_command,
    learner_command,
    reserve_generator_indexes,
    run_process,
)
from streamrl.placement import Component as Kind
from streamrl.placement import (
    PlacementPlan,
    ProcessPlacement,
    place_alone,
    plan_placement,
    write_placement,
)
from streamrl.rendezvous import LearnerNode
from streamrl.runs import open_run_location

__all__ = [
    "FINISH_GRACE_S",
    "Component",
    "ComponentFailedError",
    "ComponentLogs",
    "RestartBudget",
    "RunInterruptedError",
    "Supervisor",
    "noteworthy",
]

log = logging.getLogger(__name__)

FINISH_GRACE_S = 180.0  # generators flush, the evaluator scores the last version


class ComponentFailedError(RuntimeError):
    """A learner, generator or evaluator process failed for good; the message says which,
    how it exited and the last lines it printed."""


class RunInterruptedError(RuntimeError):
    """The run was stopped from outside (Ctrl-C, SIGTERM) and every process of it has ended."""


# What a user's terminal shows of a component's output: the learner's step lines, streamrl's
# warnings and errors (as logged by `streamrl.cli`: "<date> <time> LEVEL logger: message"). The
# rest (engine start-up, progress bars, third-party warnings) goes to the log files only.
_OWN_LINE = re.compile(
    r"^\S+ \S+ (?P<level>INFO|WARNING|ERROR|CRITICAL) (?:streamrl|storage|flows)\.\S+: "
    r"(?P<message>.*)$"
)
_RESTART = "exited with code"  # keep_running's notice, passed on with the component's lines
_STEP = re.compile(r"^step \d+(/\d+)?:")


def noteworthy(line: str) -> str | None:
    """What a terminal shows of a component's output `line`: the learner's step line or one of
    streamrl's warnings or errors, without the timestamp and logger, and the supervisor's
    restart notices; None for the rest."""
    if line.startswith(_RESTART):  # the supervisor's own notice of a restart
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


class RestartBudget:
    """How often a component may be restarted (or, on work pools, replaced): `allowed` times
    within any `window_s` seconds (default: over its whole life)."""

    def __init__(self, allowed: int, window_s: float = float("inf")) -> None:
        self.allowed, self.window_s = allowed, window_s
        self.times: deque[float] = deque()
        self.total = 0

    def spend(self, now: float | None = None) -> bool:
        """Record one restart at `now` (default: the monotonic clock); False, recording
        nothing, when none is left."""
        now = time.monotonic() if now is None else now
        while self.times and self.times[0] <= now - self.window_s:
            self.times.popleft()
        if len(self.times) >= self.allowed:
            return False
        self.times.append(now)
        self.total += 1
        return True


@dataclass
class Component:
    """One process of the run and its history under supervision."""

    name: str  # learner, gen<i>, eval
    argv: list[str]
    budget: RestartBudget
    placement: ProcessPlacement | None = None
    exit_code: int | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=20))

    @property
    def restarts(self) -> int:
        return self.budget.total


class Supervisor:
    """The supervision core: a run's processes on this machine and their restarts.

    `Supervisor.for_run(config, generators=N)`: the learner, N generators and (when configured)
    the evaluator, each started from a placement plan (default: `plan_placement` for this
    machine). `Supervisor.for_component(config, kind)`: one process of a run supervised
    elsewhere (a joining generator, or a flow run of a run placed on work pools).

    `prepare()` stores the plan (`<run>/control/placement.json`) and reserves the generator
    indexes; then each component runs under `keep_running` — on threads (`run()`, for
    `streamrl run`) or as Prefect tasks (the `streamrl` and `generator` flows). Every output
    line goes to the component's log file, then to `on_line(component, line)`. When the learner
    finishes, the others get `FINISH_GRACE_S` to flush; when a component fails for good, or on
    `abort`, everything is stopped: the run's stop marker first when this supervisor owns the
    run (so nothing restarts into it), then SIGTERM, SIGKILL after `STOP_GRACE_S`."""

    def __init__(
        self,
        config: RunConfig,
        components: list[Component],
        *,
        plan: PlacementPlan | None = None,
        owns_run: bool = True,
        on_line: Callable[[str, str], None] = lambda component, line: None,
        owner: str = "streamrl run",
    ) -> None:
        self.config = config
        self.components = components
        self.plan = plan
        self.owns_run = owns_run
        self.run_location = open_run_location(config)
        self.logs = ComponentLogs.for_run(self.run_location)
        self.on_line = on_line
        self.owner = owner
        self.stop = threading.Event()
        self.failures: list[str] = []
        self.interrupted: str | None = None

    @classmethod
    def for_run(
        cls,
        config: RunConfig,
        *,
        generators: int,
        placement: PlacementPlan | None = None,
        evaluator: bool = True,
        max_restarts: int = 3,
        learner_restarts: int = 1,
        on_line: Callable[[str, str], None] = lambda component, line: None,
        owner: str = "streamrl run",
    ) -> Supervisor:
        """The whole run: `max_restarts` restarts for each generator, `learner_restarts` for
        the learner (it resumes from its checkpoint), one for the evaluator."""
        plan = placement or plan_placement(config, generators=generators, evaluator=evaluator)
        components = [
            Component(
                "learner", learner_command(config), RestartBudget(learner_restarts), plan.learner
            ),
            *(
                Component(
                    f"gen{i}", generator_command(config, i), RestartBudget(max_restarts), placed
                )
                for i, placed in enumerate(plan.generators)
            ),
        ]
        if plan.evaluator is not None:
            components.append(
                Component("eval", evaluator_command(config), RestartBudget(1), plan.evaluator)
            )
        return cls(config, components, plan=plan, on_line=on_line, owner=owner)

    @classmethod
    def for_component(
        cls,
        config: RunConfig,
        kind: Kind,
        index: int = 0,
        *,
        node: LearnerNode | None = None,
        max_restarts: int = 0,
        on_line: Callable[[str, str], None] = lambda component, line: None,
        owner: str = "",
    ) -> Supervisor:
        """One process of a run supervised elsewhere, alone on this machine (`place_alone`):
        a learner node (`node` for one of several), generator `index` (a generator joining,
        or one of a run placed on work pools) or the evaluator. Its failure stops only itself."""
        placement = place_alone(config, kind, index)
        if kind == "learner":
            argv = learner_command(config, node)
        elif kind == "generator":
            argv = generator_command(config, index)
        else:
            argv = evaluator_command(config)
        component = Component(placement.name, argv, RestartBudget(max_restarts), placement)
        return cls(config, [component], owns_run=False, on_line=on_line, owner=owner)

    def prepare(self) -> None:
        """Store the plan and reserve the generator indexes (before starting anything)."""
        if self.plan is not None:
            write_placement(self.run_location, self.plan)
            reserve_generator_indexes(self.run_location, len(self.plan.generators), self.owner)

    def keep_running(
        self, component: Component, on_line: Callable[[str], None] | None = None
    ) -> None:
        """Run `component` until it exits 0 or the run stops, restarting it after a crash
        while its restarts last. Each line goes to its log file, then to `on_line` (default:
        the supervisor's). Raises `ComponentFailedError` (after stopping the run) when it failed
        for good."""
        show = on_line or (lambda line: self.on_line(component.name, line))

        def line(text: str) -> None:
            component.tail.append(text)
            self.logs.write(component.name, text)
            show(text)

        while not self.stop.is_set():
            component.exit_code = run_process(
                component.argv, line, self.stop, placement=component.placement
            )
            if component.exit_code == 0 or self.stop.is_set():
                if component.name == "learner" and component.exit_code == 0:
                    self._finish()
                return
            if not component.budget.spend():
                tail = "\n    ".join(list(component.tail)[-10:])
                failure = (
                    f"{component.name} failed for good (exit code {component.exit_code} after "
                    f"{component.restarts} restarts); its last lines:\n    {tail}"
                )
                self.failures.append(failure)
                self.abort(f"{component.name} failed")
                raise ComponentFailedError(failure)
            show(
                f"{_RESTART} {component.exit_code}; restart {component.restarts} of "
                f"{component.budget.allowed} (log: {self.logs.folder / component.name}.log)"
            )

    def run(self) -> dict[str, Any]:
        """`streamrl run`: every component on a thread of this process until the learner is
        done. Ctrl-C or SIGTERM stops the run (`RunInterruptedError` once every process has
        ended); a component that failed for good raises `ComponentFailedError`. Returns each
        component's exit code and restarts."""
        self.prepare()
        threads = [
            threading.Thread(target=self._keep_running_quietly, args=(c,), name=c.name)
            for c in self.components
        ]
        with _sigterm_as_interrupt():
            for thread in threads:
                thread.start()
            try:
                for thread in threads:
                    while thread.is_alive():
                        thread.join(timeout=0.5)
            except KeyboardInterrupt:
                self.abort("interrupted (Ctrl-C or SIGTERM)", interrupted=True)
                for thread in threads:
                    thread.join()
        self.logs.close()
        if self.failures:
            raise ComponentFailedError("; ".join(self.failures))
        if self.interrupted:
            raise RunInterruptedError(self.interrupted)
        return self.result()

    def result(self) -> dict[str, Any]:
        return {c.name: {"exit_code": c.exit_code, "restarts": c.restarts} for c in self.components}

    def _keep_running_quietly(self, component: Component) -> None:
        with contextlib.suppress(ComponentFailedError):  # recorded in self.failures
            self.keep_running(component)

    def _finish(self) -> None:
        """The learner is done and has set the stop marker: the generators flush and exit, the
        evaluator scores the last version; whatever still runs after a grace period is stopped."""
        deadline = threading.Timer(FINISH_GRACE_S, self.stop.set)
        deadline.daemon = True  # never keeps the supervisor alive once everything exited
        deadline.start()

    def abort(self, reason: str, *, interrupted: bool = False) -> None:
        """Stop everything now: the stop marker (so nothing restarts into the run), then
        SIGTERM to every process (SIGKILL after `STOP_GRACE_S`). `interrupted`: stopped from
        outside (Ctrl-C, SIGTERM), not by a failure."""
        if interrupted and self.interrupted is None:
            self.interrupted = reason
        try:
            if self.owns_run and not stop_requested(self.run_location):
                request_stop(self.run_location, reason)
        except OSError as exc:  # storage unreachable: the processes are stopped all the same
            log.warning("could not write the run's stop marker: %r", exc)
        self.stop.set()


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM to the supervisor stops the run as Ctrl-C does (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
