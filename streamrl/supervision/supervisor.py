"""The supervision core's local backend: one run's processes on this machine, kept running until the
run is done — for `streamrl run`, the `streamrl` and `generator` Prefect flows and `make demo` alike
(`Supervisor`). What follows each exit — a restart, the others finishing after the learner's
success, the run stopping — is the restart policy's (`streamrl.supervision.policy`, shared with runs
on work pools). Each output line goes to the component's log file, the few a terminal shows to the
caller (`streamrl.supervision.output`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from storage.control.lease import DISPLACED, NOT_HOLDER_EXIT_CODE
from storage.control.requests import request_stop, stop_requested
from streamrl.config.run import RunConfig
from streamrl.config.stored import open_run_location
from streamrl.generator.index import reserve_generator_indexes
from streamrl.placement import Component as Kind
from streamrl.placement import (
    PlacementPlan,
    ProcessPlacement,
    place_alone,
    plan_placement,
    write_placement,
)
from streamrl.placement.handoff import remove_handoff
from streamrl.scorers.config import scorer_process_name
from streamrl.supervision.launch import (
    STOP_GRACE_S,
    evaluator_command,
    generator_command,
    learner_command,
    learner_env,
    run_process,
    scorer_command,
)
from streamrl.supervision.liveness import LivenessWatch
from streamrl.supervision.output import RESTART_NOTICE, ComponentLogs
from streamrl.supervision.policy import (
    NOT_RESTARTED,
    STOPPED_FROM_OUTSIDE,
    USER_CODE_EXIT_CODE,
    Abort,
    Action,
    Cancel,
    Ended,
    Event,
    Failure,
    Finish,
    Interrupted,
    Start,
    SupervisionPolicy,
    Tick,
    Unit,
)
from streamrl.supervision.rendezvous import LearnerNode
from streamrl.supervision.signals import stop_signals, stopping_despite_interrupts

__all__ = [
    "Component",
    "ComponentFailedError",
    "RunInterruptedError",
    "Supervisor",
]

log = logging.getLogger(__name__)


class ComponentFailedError(RuntimeError):
    """A learner, generator or evaluator process failed for good; the message says which,
    how it exited and the last lines it printed."""


class RunInterruptedError(RuntimeError):
    """The run was stopped from outside (Ctrl-C, SIGTERM) and every process of it has ended."""


@dataclass
class Component:
    """One process of the run and its history under supervision."""

    unit: Unit  # what the restart policy knows it as (after a learner restart: the new attempt)
    argv: list[str]
    placement: ProcessPlacement | None = None
    node: LearnerNode | None = None  # a learner node's place among several nodes
    exit_code: int | None = None
    restarts: int = 0
    stop: threading.Event = field(default_factory=threading.Event)  # set: stopped, not restarted
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=20))
    # Its process said it stopped on a signal from outside (`STOPPED_FROM_OUTSIDE`): read as each
    # line arrives, since torchrun's report of its ranks' exits may follow it by many lines.
    stopped_from_outside: bool = False
    stalled: str | None = None  # why its last process was ended as hung (liveness)
    stalls: int = 0  # processes of it ended as hung

    @property
    def name(self) -> str:
        return self.unit.name


class Supervisor:
    """The supervision core: a run's processes on this machine and their restarts.

    `Supervisor.for_run(config, generators=N)`: the learner, N generators and (when configured)
    the evaluator, each started from a placement plan (default: `plan_placement` for this
    machine). `Supervisor.for_component(config, kind)`: one process of a run supervised
    elsewhere (a joining generator, or a flow run of a run placed on work pools).

    `prepare()` stores the plan (`<run>/control/placement.json`) and reserves the generator
    indexes; then each component runs under `keep_running` — on threads (`run()`, for
    `streamrl run`) or as Prefect tasks (the `streamrl` and `generator` flows). Every output
    line goes to the component's log file, then to `on_line(component, line)`. Each exit goes
    to the one restart policy of all the threads, and this backend carries out its answer: a
    restart; the others finishing after the learner's success (`FINISH_GRACE_S`); or, when a
    component failed for good or on `abort`, everything stopped: the run's stop marker first
    when this supervisor owns the run, then SIGTERM, SIGKILL after `STOP_GRACE_S`."""

    def __init__(
        self,
        config: RunConfig,
        policy: SupervisionPolicy,
        components: list[Component],
        *,
        plan: PlacementPlan | None = None,
        owns_run: bool = True,
        on_line: Callable[[str, str], None] = lambda component, line: None,
        owner: str = "streamrl run",
    ) -> None:
        self.config = config
        self.policy = policy
        self.components = components
        self.plan = plan
        self.owns_run = owns_run
        self.run_location = open_run_location(config)
        self.logs = ComponentLogs.for_run(self.run_location)
        self.on_line = on_line
        self.owner = owner
        self.failures: list[str] = []
        self.interrupted: str | None = None
        self.liveness = LivenessWatch(self.run_location, config.placement)
        self._policy_lock = threading.Lock()  # one event at a time, from every thread

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
        policy = SupervisionPolicy(
            learner_nodes=1,
            generators=range(len(plan.generators)),
            evaluator=plan.evaluator is not None,
            scorers=[p.name for p in plan.scorers],
            learner_retries=learner_restarts,
            generator_retries=max_restarts,
            evaluator_retries=1,
            scorer_retries=max_restarts,
        )

        def component(unit: Unit) -> Component:
            return Component(unit, _command(config, unit), plan.placement_of(unit.kind, unit.index))

        components = [component(unit) for start in policy.start() for unit in start.units]
        return cls(config, policy, components, plan=plan, on_line=on_line, owner=owner)

    @classmethod
    def for_component(
        cls,
        config: RunConfig,
        kind: Kind,
        index: int = 0,
        *,
        node: LearnerNode | None = None,
        take_over: bool = False,
        max_restarts: int = 0,
        on_line: Callable[[str, str], None] = lambda component, line: None,
        owner: str = "",
    ) -> Supervisor:
        """One process of a run supervised elsewhere, alone on this machine (`place_alone`):
        a learner node (`node` for one of several), generator `index` (a generator joining, or
        one of a run placed on work pools) or the evaluator. Its failure stops only itself.
        `take_over`: its previous process is known to have ended (see `_command`)."""
        policy = SupervisionPolicy(
            learner_nodes=int(kind == "learner"),
            generators=[index] if kind == "generator" else [],
            evaluator=kind == "evaluator",
            scorers=[scorer_process_name(config.served_scorers[index])] if kind == "scorer" else [],
            learner_retries=max_restarts,
            generator_retries=max_restarts,
            evaluator_retries=max_restarts,
            scorer_retries=max_restarts,
        )
        (unit,) = policy.live
        argv = _command(config, unit, node, take_over=take_over)
        component = Component(unit, argv, place_alone(config, kind, index), node)
        return cls(config, policy, [component], owns_run=False, on_line=on_line, owner=owner)

    def prepare(self) -> None:
        """Store the plan and reserve the generator indexes (before starting anything)."""
        if self.plan is not None:
            write_placement(self.run_location, self.plan)
            reserve_generator_indexes(self.run_location, len(self.plan.generators), self.owner)

    def finish(self) -> None:
        """Once every process ended: close the log files and remove what the run kept in this
        machine's memory (the learner's weight hand-off, `streamrl.placement.handoff`)."""
        self.logs.close()
        if self.plan is not None and self.plan.learner.handoff:
            remove_handoff(self.run_location.uri)

    def keep_running(
        self, component: Component, on_line: Callable[[str], None] | None = None
    ) -> None:
        """Run `component`'s process, again and again while the restart policy says so.

        Consumes its output lines (each to its log file, then to `on_line`, default: the
        supervisor's) and its exit, which goes to the policy (`_ended`). Produces a restart (its
        notice shown as a line), or returns: it is done (completed, asked to stop, or the run
        is finishing or stopping). Waits for its process; `component.stop` (abort, the end of
        the finishing grace) stops it. Raises `ComponentFailedError` (after stopping the run)
        when it failed for good."""
        show = on_line or (lambda line: self.on_line(component.name, line))

        def line(text: str) -> None:
            if STOPPED_FROM_OUTSIDE in text and component.unit.kind == "learner":
                component.stopped_from_outside = True
            component.tail.append(text)
            self.logs.write(component.name, text)
            show(text)

        self._wait_for_gpu_peers(component, show)
        while not component.stop.is_set():
            component.stopped_from_outside, component.stalled = False, None
            component.exit_code = run_process(
                component.argv,
                line,
                component.stop,
                env=learner_env(self.config) if component.unit.kind == "learner" else None,
                placement=component.placement,
                grace_s=self._grace_s(component),
                stalled=self._liveness(component),
            )
            notice = self._ended(component)
            if notice is None:
                return
            show(notice)

    def _wait_for_gpu_peers(self, component: Component, show: Callable[[str], None]) -> None:
        """A learner on a GPU it shares with generators starts once their engines are up (their
        first heartbeat), or after `placement.startup_timeout_s`: a vLLM engine sizes its KV
        cache from the memory it sees free while it starts, which a learner allocating at the
        same time would take from under it."""
        if component.unit.kind != "learner" or self.plan is None or component.placement is None:
            return
        mine = set(component.placement.gpus)
        peers = [g.name for g in self.plan.generators if mine & set(g.gpus)]
        if not peers:
            return
        show(f"waiting for {', '.join(peers)} to start its engine on the GPU it shares")
        deadline = time.monotonic() + self.config.placement.startup_timeout_s
        while not component.stop.is_set() and time.monotonic() < deadline:
            watched = [self.liveness.watched.get(name) for name in peers]
            if all(w is not None and w.changed is not None for w in watched):
                return
            component.stop.wait(1.0)

    def _liveness(self, component: Component) -> Callable[[], str | None] | None:
        """For a learner (its first node) or a generator: the check `run_process` asks whether
        its process is hung; the reason is logged and kept for the restart's cause."""
        kind, name = component.unit.kind, component.name
        if kind not in ("learner", "generator") or (component.node and component.node.node_rank):
            return None
        beats = "learner" if kind == "learner" else name
        self.liveness.started(beats, kind)

        def stalled() -> str | None:
            reason = self.liveness.stalled(beats)
            if reason is not None:
                component.stalled, component.stalls = reason, component.stalls + 1
                log.warning(f"{name} is hung, %s: ending it", reason)
            return reason

        return stalled

    def _grace_s(self, component: Component) -> float:
        """How long a stopped component has before SIGKILL: a learner its `stop_grace_s` (for
        the checkpoint on stop) and a margin, at least what every component has."""
        if component.unit.kind != "learner":
            return STOP_GRACE_S
        return max(STOP_GRACE_S, self.config.learner.stop_grace_s + 10.0)

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
        with stop_signals(self.config.learner.stop_grace_s) as signalled:
            for thread in threads:
                thread.start()
            while any(t.is_alive() for t in threads) and not signalled.wait(0.5):
                pass
            if signalled.is_set():
                with stopping_despite_interrupts(self.config.learner.stop_grace_s):
                    self.abort(f"interrupted ({signalled.name})", interrupted=True)
                    for thread in threads:
                        thread.join()
        self.finish()
        if self.failures:
            raise ComponentFailedError("; ".join(self.failures))
        if self.interrupted:
            raise RunInterruptedError(self.interrupted)
        return self.result()

    def result(self) -> dict[str, Any]:
        return {
            c.name: {"exit_code": c.exit_code, "restarts": c.restarts}
            | ({"hung": c.stalls} if c.stalls else {})
            for c in self.components
        }

    def abort(self, reason: str, *, interrupted: bool = False) -> None:
        """Stop everything now: the stop marker (so nothing restarts into the run), then
        SIGTERM to every process (SIGKILL after `STOP_GRACE_S`); nothing restarts after it.
        `interrupted`: stopped from outside (Ctrl-C, SIGTERM), not by a failure."""
        if interrupted and self.interrupted is None:
            self.interrupted = reason
        self._act(Interrupted(reason))

    def _keep_running_quietly(self, component: Component) -> None:
        with contextlib.suppress(ComponentFailedError):  # recorded in self.failures
            self.keep_running(component)

    # -- the policy's answers -----------------------------------------------------------------

    def _decide(self, event: Event) -> list[Action]:
        with self._policy_lock:
            return self.policy.handle(event)

    def _act(self, event: Event) -> None:
        for action in self._decide(event):
            self._carry_out(action)

    def _ended(self, component: Component) -> str | None:
        """Tell the policy that `component`'s process exited and carry out its answer; the
        restart notice when the component runs again, else None. Here an exit can only
        restart its own component: one learner node, no scaling."""
        code = component.exit_code
        # Under torchrun a rank's exit code is lost; the learner's own line says it too.
        said = any(DISPLACED in line for line in component.tail)
        holds_a_lease = component.unit.kind in ("learner", "generator")
        displaced = holds_a_lease and (code == NOT_HOLDER_EXIT_CODE or said)
        cause = f"exit code {code}"
        if component.stalled:
            cause = f"hung ({component.stalled}), then {cause}"
        deterministic = code == USER_CODE_EXIT_CODE
        if deterministic:  # its error line says what to change
            errors = [line for line in component.tail if line.startswith("error: ")]
            cause += f": {errors[-1].removeprefix('error: ')}" if errors else ""
        # A hung process ended by its supervisor has failed, however it exited once continued;
        # so has a generator that stopped with nothing asking it to (SIGTERM sent to it alone).
        completed = code == 0 and component.stalled is None
        if completed and component.unit.kind == "generator" and not self._stop_asked(component):
            completed, cause = False, f"{cause}, stopped from outside with no stop marker"
        event = Ended(
            component.unit, completed, time.monotonic(), cause, displaced=displaced,
            deterministic=deterministic, signalled=self._signalled(component),
        )  # fmt: skip
        notice = None
        for action in self._decide(event):
            match action:
                case Start(units=(unit,), take_over=take_over, restart=Failure() as failure):
                    component.unit, component.restarts = unit, failure.restarts
                    if take_over:  # its previous process has ended: take its lease over
                        component.argv = _command(self.config, unit, component.node, take_over=True)
                    hung = f" (hung: {component.stalled})" if component.stalled else ""
                    notice = (
                        f"{RESTART_NOTICE} {code}{hung}; restart {failure.restarts} of "
                        f"{failure.allowed} (log: {self.logs.folder / component.name}.log)"
                    )
                case _:
                    self._carry_out(action)
        return notice

    @staticmethod
    def _signalled(component: Component) -> bool:
        """The learner stopped on a signal someone else sent: not one this supervisor sent,
        stopping it (the run's stop, or ending it as hung)."""
        return (
            component.stopped_from_outside
            and component.stalled is None
            and not component.stop.is_set()
        )

    def _stop_asked(self, component: Component) -> bool:
        """Whether the run's stop marker or `component`'s own exists (unreadable: yes, so
        nothing restarts into a run that may be stopping)."""
        try:
            return stop_requested(self.run_location, component.name)
        except Exception as exc:  # storage unreachable (any backend's error)
            log.warning("could not read the stop markers of %s: %r", component.name, exc)
            return True

    def _carry_out(self, action: Action) -> None:
        """Finishing, cancelling and aborting, whichever thread the policy answered."""
        match action:
            case Finish(deadline=deadline):
                wait = max(0.0, deadline - time.monotonic())
                timer = threading.Timer(wait, self._act, args=(Tick(deadline),))
                timer.daemon = True  # never keeps the supervisor alive once everything exited
                timer.start()
            case Cancel(units=units):
                for component in self.components:
                    if component.unit in units:
                        component.stop.set()
            case Abort(reason=reason, failure=failure, interrupted=interrupted):
                if interrupted and self.interrupted is None:
                    self.interrupted = reason
                if failure is not None:
                    self.failures.append(self._failed_for_good(failure))
                self._stop_run(reason)
                if failure is not None:
                    raise ComponentFailedError(self.failures[-1])

    def _failed_for_good(self, failure: Failure) -> str:
        component = next(c for c in self.components if c.unit == failure.unit)
        tail = "\n    ".join(list(component.tail)[-10:])
        if failure.deterministic:
            why = f"cannot run ({failure.cause}); {NOT_RESTARTED}"
        else:
            why = f"failed for good ({failure.cause} after {failure.restarts} restarts)"
        return f"{component.name} {why}; its last lines:\n    {tail}"

    def _stop_run(self, reason: str) -> None:
        """The stop marker when this supervisor owns the run, then every process stopped."""
        try:
            if self.owns_run and not stop_requested(self.run_location):
                request_stop(self.run_location, reason)
        except Exception as exc:  # storage unreachable (any backend's error): stop them anyway
            log.warning("could not write the run's stop marker: %r", exc)
        for component in self.components:
            component.stop.set()


def _command(
    config: RunConfig, unit: Unit, node: LearnerNode | None = None, *, take_over: bool = False
) -> list[str]:
    """The command line of `unit`; `take_over`: its previous process has ended, so it takes
    that one's lease over at once (the learner's on the run, a generator's on its index)."""
    if unit.kind == "learner":
        return learner_command(config, node, take_over=take_over)
    if unit.kind == "generator":
        return generator_command(config, unit.index, take_over=take_over)
    if unit.kind == "scorer":
        return scorer_command(config, config.served_scorers[unit.index])
    return evaluator_command(config)
