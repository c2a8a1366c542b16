"""A run placed on Prefect work pools (`placement.mode: pools`): each process its own flow run,
supervised through Prefect states.

The `streamrl` flow starts, with Prefect's `run_deployment` (child flow runs of its own, shown
under it in the UI):

- the learner: `learner.nnodes` runs of the `learner` flow's deployment on
  `placement.learner_pool`, one per node (`flows.learner`; the nodes meet through the run's
  storage, `streamrl.supervision.rendezvous`);
- each generator: a run of the `generator` flow's deployment on `placement.generator_pool`;
- the evaluator (when `eval.every_versions` > 0): a run of the `evaluator` flow's deployment on
  `placement.eval_pool` (default: the generator pool),

each with the job variables its pool's template declares: `gpu_count` from the configuration
(the learner's ranks per node, an engine's tensor-parallel GPUs), `image` and `env`
(`placement.image`, `placement.env`), a learner node's `nano_cpus` (`learner.cpu_cores`).

`PoolSupervisor.poll()` reads the children's states and `<run>/control/fleet.json` (`streamrl
scale`), hands what changed to the restart policy (`streamrl.supervision.policy`: the same rules as
for processes on one machine) and carries out its answer: a lost generator replaced by a new run of
its index (`generator_retries` within `placement.retry_window_s`; none when its own supervisor says
a restart would fail the same way: the run stops); a failed learner attempt's other nodes cancelled
and, once they have ended or are fenced, every node started again as the next attempt (resuming from
the last committed checkpoint, taking the run's lease over; `learner_retries` times); the evaluator
restarted once; the generators flushing once every learner node completed (what still runs after
`FINISH_GRACE_S` is cancelled); more generators started on new indexes, or the newest asked to stop
through their own stop marker (they flush their open segment first, then their runs complete).

Failing for good, or an interrupted parent (cancelled, Ctrl-C), writes the stop marker and
cancels every child still running (Prefect's server also cancels the children of a cancelled
flow run).
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import (
    FlowFilter,
    FlowFilterName,
    FlowRunFilter,
    FlowRunFilterId,
    WorkPoolFilter,
    WorkPoolFilterName,
)
from prefect.client.schemas.objects import StateType
from prefect.deployments import run_deployment
from prefect.states import Cancelled, Cancelling

from storage.control.lease import DISPLACED
from storage.control.requests import (
    clear_stop,
    request_stop,
    requested_generators,
    set_requested_generators,
    stop_requested,
)
from streamrl.config.run import RunConfig
from streamrl.config.stored import open_run_location
from streamrl.generator.index import claim_generator_index, reserve_generator_indexes
from streamrl.placement import Component as Kind
from streamrl.scorers.config import ScorerConfig, scorer_process_name
from streamrl.supervision.liveness import LivenessWatch
from streamrl.supervision.policy import (
    NOT_RESTARTED,
    Abort,
    Action,
    Cancel,
    Ended,
    Event,
    Failure,
    Finish,
    Interrupted,
    ScaleOut,
    Start,
    StopGenerator,
    SupervisionPolicy,
    TargetGenerators,
    Tick,
    Unit,
)
from streamrl.supervision.supervisor import ComponentFailedError

__all__ = ["PoolError", "PoolSupervisor", "job_variables"]

log = logging.getLogger(__name__)

# The flow each kind of process runs as (flows/learner.py, flows/generator.py, flows/evaluator.py).
FLOWS: dict[Kind, str] = {
    "learner": "learner",
    "generator": "generator",
    "evaluator": "evaluator",
    "scorer": "scorer",
}
# `prefect deploy -n` names a deployment of deploy/prefect.yaml by its entrypoint's function
# (the deployment is then `<flow>/default`).
_ENTRYPOINTS: dict[Kind, str] = {
    "learner": "learner_node",
    "generator": "join_run",
    "evaluator": "evaluate_run",
    "scorer": "serve_scorer",
}
_POOL_FIELDS: dict[Kind, str] = {
    "learner": "placement.learner_pool",
    "generator": "placement.generator_pool",
    "evaluator": "placement.eval_pool",
    "scorer": "placement.scorer_pool",
}
_NOT_STARTED = {StateType.SCHEDULED, StateType.PENDING, StateType.PAUSED}


class PoolError(RuntimeError):
    """A work pool cannot run what the run places on it; the message names the fix."""


@dataclass
class Child:
    """One flow run of the run's processes: the policy's unit it runs."""

    unit: Unit
    parameters: dict[str, Any]
    flow_run_id: UUID
    state: StateType | None = None
    message: str = ""

    @property
    def name(self) -> str:  # learner, learner-node1, gen3, eval
        return self.unit.name

    @property
    def kind(self) -> Kind:
        return self.unit.kind

    @property
    def ended(self) -> bool:
        return self.state is not None and self.state in _FINAL

    @property
    def completed(self) -> bool:
        return self.state == StateType.COMPLETED


_FINAL = {StateType.COMPLETED, StateType.FAILED, StateType.CRASHED, StateType.CANCELLED}


def job_variables(
    config: RunConfig, kind: Kind, declared: set[str], scorer: ScorerConfig | None = None
) -> dict[str, Any]:
    """The job variables a flow run of `kind` (of `scorer`, for a scorer) gets on a pool whose
    template declares `declared`: `gpu_count` (the learner's ranks per node, or an engine's
    GPUs; 0 on CPU), `image` and `env` from `placement`, and a learner node's `nano_cpus`
    (CPUs × 10⁹: `learner.cpu_cores`, the cores its node binds its ranks to; an engine binds to
    every core its container shows, so its CPUs stay the pool's). Variables the pool does not
    declare are left out."""
    if kind == "learner":
        gpus = 0 if config.learner.device == "cpu" else config.learner.nproc_per_node
    elif scorer is not None:
        gpus = 0 if scorer.device == "cpu" else scorer.tensor_parallel_size
    else:
        gpus = 0 if config.generator.device == "cpu" else config.generator.tensor_parallel_size
    wanted: dict[str, Any] = {"gpu_count": gpus}
    cores = config.learner.cpu_cores if kind == "learner" else None
    if cores is not None:
        wanted["nano_cpus"] = (cores if isinstance(cores, int) else len(cores)) * 10**9
    if config.placement.image:
        wanted["image"] = config.placement.image
    if config.placement.env:
        wanted["env"] = dict(config.placement.env)
    return {k: v for k, v in wanted.items() if k in declared}


@dataclass
class _Target:
    """Where flow runs of one kind go: the deployment and what its pool's template declares."""

    deployment_id: UUID
    name: str  # flow/deployment
    pool: str
    declared: set[str] = field(default_factory=set)


class PoolSupervisor:
    """A run's learner, generators and evaluator as flow runs on work pools (module docstring).

    `start()` launches them; `poll()`, every few seconds, until it returns True (the run is
    done); `abort(reason)` when interrupted. Every decision is the policy's (`self.policy`);
    this backend starts flow runs, reads their states and cancels them."""

    def __init__(
        self,
        config: RunConfig,
        client: SyncPrefectClient,
        *,
        generators: int,
        generator_retries: int = 3,
        learner_retries: int = 1,
        evaluator: bool = True,
        logger: logging.Logger | logging.LoggerAdapter = log,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config, self.client, self.log, self.clock = config, client, logger, clock
        self.run = open_run_location(config)
        self.generators = generators
        self.with_eval = evaluator and config.eval.every_versions > 0
        self.policy = SupervisionPolicy(
            learner_nodes=config.learner.nnodes,
            generators=range(generators),
            evaluator=self.with_eval,
            scorers=[scorer_process_name(name) for name in config.served_scorers],
            learner_retries=learner_retries,
            generator_retries=generator_retries,
            generator_window_s=config.placement.retry_window_s,
            evaluator_retries=1,
            scorer_retries=generator_retries,
        )
        self.children: list[Child] = []
        self.failure: str | None = None
        self.liveness = LivenessWatch(self.run, config.placement)
        self.hung: dict[str, int] = {}  # flow runs cancelled as hung, by unit name
        self.rendezvous = uuid.uuid4().hex[:12]  # attempt k's nodes meet as `<rendezvous>-<k>`
        self.targets: dict[Kind, _Target] = {}

    # -- starting ---------------------------------------------------------------------------

    def start(self) -> None:
        """Find the deployments, reserve generator indexes, start every process."""
        placement = self.config.placement
        pools: dict[Kind, str] = {
            "learner": placement.learner_pool,
            "generator": placement.generator_pool,
        }
        if self.with_eval:
            pools["evaluator"] = placement.evaluator_pool
        if self.config.served_scorers:
            pools["scorer"] = placement.scorers_pool
        self.targets = {kind: self._target(kind, pool) for kind, pool in pools.items()}
        reserve_generator_indexes(self.run, self.generators, "streamrl flow (pools)")
        set_requested_generators(self.run, self.generators)
        self._act(self.policy.start())

    def _target(self, kind: Kind, pool: str) -> _Target:
        flow = FLOWS[kind]
        found = self.client.read_deployments(
            flow_filter=FlowFilter(name=FlowFilterName(any_=[flow])),
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])),
        )
        if not found:
            raise PoolError(
                f"no deployment of the `{flow}` flow on work pool '{pool}' ({_POOL_FIELDS[kind]});"
                f" deploy one: prefect deploy --prefect-file deploy/prefect.yaml --no-prompt "
                f"-n {_ENTRYPOINTS[kind]}/default --pool {pool}"
            )
        deployment = min(found, key=lambda d: (d.name != "default", d.name))
        template = self.client.read_work_pool(pool).base_job_template or {}
        declared = set(template.get("variables", {}).get("properties", {}))
        if self.config.placement.image and "image" not in declared:
            self.log.warning(
                "work pool '%s' has no `image` job variable: placement.image is not used there",
                pool,
            )
        return _Target(deployment.id, f"{flow}/{deployment.name}", pool, declared)

    def _start(self, start: Start) -> None:
        """A flow run for each unit of `start`, on its kind's deployment and pool."""
        if (failure := start.restart) is not None:
            within = f" within {failure.window_s:.0f}s" if math.isfinite(failure.window_s) else ""
            resumes = "; the learner resumes from the last checkpoint" if start.take_over else ""
            self.log.warning(
                "%s; restart %d (%d of %d allowed%s)%s", failure.cause, failure.restarts,
                failure.recent, failure.allowed, within, resumes,
            )  # fmt: skip
        for unit in start.units:
            if unit.kind == "generator":
                clear_stop(self.run, writer=unit.name)  # a stopped index may run again
            self._launch(unit, self._parameters(unit, start.take_over))

    def _parameters(self, unit: Unit, take_over: bool) -> dict[str, Any]:
        """What the flow run of `unit` is called with (flows/learner.py, flows/generator.py,
        flows/evaluator.py, flows/scorer.py)."""
        run_uri = self.config.storage.run_uri
        if unit.kind == "learner":
            attempt = f"{self.rendezvous}-{unit.attempt}"
            return {"run_uri": run_uri, "node_rank": unit.index, "attempt": attempt,
                    "take_over": take_over}  # fmt: skip
        if unit.kind == "generator":  # its replacement is ours: the flow run restarts nothing
            return {"run_uri": run_uri, "index": unit.index, "retries": 0}
        if unit.kind == "scorer":
            return {"run_uri": run_uri, "index": unit.index}
        return {"run_uri": run_uri}

    def _launch(self, unit: Unit, parameters: dict[str, Any]) -> None:
        target = self.targets[unit.kind]
        scorer = None
        if unit.kind == "scorer":
            scorer = self.config.scorers[self.config.served_scorers[unit.index]]
        variables = job_variables(self.config, unit.kind, target.declared, scorer)
        flow_run = run_deployment(
            target.deployment_id,
            parameters=parameters,
            flow_run_name=f"{self.config.run_name}-{unit.name}",
            timeout=0,
            job_variables=variables or None,
            tags=["streamrl", unit.kind],
        )
        self.children.append(Child(unit, parameters, flow_run.id, flow_run.state_type))
        if unit.kind == "generator" or (unit.kind == "learner" and unit.index == 0):
            self.liveness.started(_beats(unit), unit.kind)
        self.log.info("started %s: flow run %s on pool '%s'", unit.name, flow_run.name, target.pool)

    # -- watching ---------------------------------------------------------------------------

    def live(self, kind: Kind | None = None) -> list[Child]:
        return [c for c in self.children if not c.ended and (kind is None or c.kind == kind)]

    def poll(self) -> bool:
        """One look at the run; True when it is done.

        Consumes the children's states (from Prefect's server), `<run>/control/fleet.json`
        and the clock; each child that ended since the last poll, the time and the generator
        count asked for go to the policy as events, and its actions are carried out (flow
        runs started, asked to stop, cancelled). Raises `ComponentFailedError` (after
        cancelling every child) when a component failed for good."""
        now = self.clock()
        for child in self._refresh():
            stopped = stop_requested(self.run, child.name)
            displaced = child.unit.kind == "learner" and DISPLACED in child.message
            repeats = NOT_RESTARTED in child.message  # its own supervisor said so
            cause = self._describe(child)
            self._feed(Ended(child.unit, child.completed, now, cause, stopped, displaced, repeats))
        self._cancel_hung()
        self._feed(Tick(now))
        wanted = requested_generators(self.run, self.config.placement.max_generators)
        if wanted is not None:
            self._feed(TargetGenerators(wanted))
        return self.policy.done

    def _cancel_hung(self) -> None:
        """Cancel each live learner or generator flow run whose process stopped beating
        (`streamrl.supervision.liveness`): its end is then a failure, replaced as a crash is."""
        for child in self.live():
            beats = _beats(child.unit)
            node_k = child.unit.kind == "learner" and child.unit.index > 0  # node 0 beats alone
            if node_k or beats not in self.liveness.watched:
                continue
            if child.state in _NOT_STARTED:  # waiting for a worker: its clock starts later
                self.liveness.started(beats, child.unit.kind)
                continue
            reason = self.liveness.stalled(beats)
            if reason is None:
                continue
            self.liveness.forget(beats)
            self.hung[child.name] = self.hung.get(child.name, 0) + 1
            self.log.warning(f"{child.name} is hung, %s: cancelling its flow run", reason)
            self._cancel([child], f"hung: {reason}")

    def _refresh(self) -> list[Child]:
        """Read the states of the children not known to have ended; those that now have."""
        waiting = [c for c in self.children if not c.ended]
        if not waiting:
            return []
        runs = self.client.read_flow_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[c.flow_run_id for c in waiting]))
        )
        by_id = {run.id: run for run in runs}
        for child in waiting:
            run = by_id.get(child.flow_run_id)
            if run is not None and run.state is not None:
                child.state, child.message = run.state.type, run.state.message or ""
        return [c for c in waiting if c.ended]

    def _describe(self, child: Child) -> str:
        state = child.state.value.lower() if child.state else "unknown"
        return f"{child.name} ({state}{': ' + child.message if child.message else ''})"

    def abort(self, reason: str) -> None:
        """Stop the run: its stop marker, then every child still running is cancelled."""
        self._feed(Interrupted(reason))

    def restarts(self) -> dict[str, int]:
        return {name: count for name, count in self.policy.restarts().items() if count}

    # -- carrying out the policy's actions ----------------------------------------------------

    def _feed(self, event: Event) -> None:
        self._act(self.policy.handle(event))

    def _act(self, actions: Iterable[Action]) -> None:
        """Carry out `actions`, then the policy's answers to the events they cause (a flow run
        cancelled before it started has ended at once), until none is left."""
        pending = deque(actions)
        while pending:
            for event in self._carry_out(pending.popleft()):
                pending.extend(self.policy.handle(event))

    def _carry_out(self, action: Action) -> list[Event]:
        match action:
            case Start():
                self._start(action)
            case ScaleOut(count=count, wanted=wanted):
                for _ in range(count):
                    index = claim_generator_index(self.run, owner="streamrl flow (pools)")
                    self.log.info("scaling out to %d generators: gen%d", wanted, index)
                    self._start(Start((self.policy.add_generator(index),)))
            case StopGenerator(unit=unit, reason=reason):
                self.log.info("%s: %s flushes and stops", reason, unit.name)
                request_stop(self.run, reason, writer=unit.name)
            case Cancel(units=units, reason=reason):
                return self._cancel([c for c in self.live() if c.unit in units], reason)
            case Finish():
                self.log.info("the learner completed; the generators flush and stop")
            case Abort(reason=reason, failure=None):
                self._abort(reason)
            case Abort(failure=Failure() as failure):
                self.failure = self._failed_for_good(failure)
                self._abort(self.failure)
                raise ComponentFailedError(self.failure)
        return []

    def _cancel(self, children: list[Child], reason: str) -> list[Event]:
        """Cancel `children`; the end of those that never started (cancelled at once)."""
        ended: list[Event] = []
        for child in children:
            state = Cancelled if child.state in _NOT_STARTED else Cancelling
            try:
                self.client.set_flow_run_state(child.flow_run_id, state(message=reason), force=True)
            except Exception as exc:  # the server unreachable: Prefect's own cleanup remains
                self.log.warning("could not cancel %s: %r", child.name, exc)
                continue
            if state is Cancelled:
                child.state = StateType.CANCELLED
                ended.append(Ended(child.unit, False, self.clock(), self._describe(child)))
        return ended

    @staticmethod
    def _failed_for_good(failure: Failure) -> str:
        unit = failure.unit
        if failure.deterministic:  # the cause, its flow run's message, says why
            return f"{unit.name} cannot run: {failure.cause}"
        if unit.kind == "generator":
            return (
                f"{unit.name} failed for good ({failure.allowed} replacements within "
                f"{failure.window_s:.0f}s): {failure.cause}"
            )
        return f"the {unit.kind} failed for good: {failure.cause}"

    def _abort(self, reason: str) -> None:
        """The run's stop marker, then every child still running cancelled."""
        try:
            request_stop(self.run, reason)
        except Exception as exc:  # storage unreachable (any backend's error): cancel anyway
            self.log.warning("could not write the run's stop marker: %r", exc)
        self._refresh()
        self._cancel(self.live(), reason)


def _beats(unit: Unit) -> str:
    """The heartbeat record a unit's process writes (`storage.control.heartbeat`)."""
    return "learner" if unit.kind == "learner" else unit.name
