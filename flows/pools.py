"""A run placed on Prefect work pools (`placement.mode: pools`): each process its own flow run,
supervised through Prefect states.

The `streamrl` flow starts, with Prefect's `run_deployment` (child flow runs of its own, shown
under it in the UI):

- the learner: `learner.nnodes` runs of the `learner` flow's deployment on
  `placement.learner_pool`, one per node (`flows.learner`; the nodes meet through the run's
  storage, `streamrl.rendezvous`);
- each generator: a run of the `generator` flow's deployment on `placement.generator_pool`;
- the evaluator (when `eval.every_versions` > 0): a run of the `evaluator` flow's deployment on
  `placement.eval_pool` (default: the generator pool),

each with the job variables its pool's template declares: `gpu_count` from the configuration
(the learner's ranks per node, an engine's tensor-parallel GPUs), `image` and `env`
(`placement.image`, `placement.env`).

`PoolSupervisor.poll()` reads the children's states and acts:

- a generator run that ended before the run asked it to stop (crashed, failed, cancelled,
  preempted) is replaced by a new run of the same index; replacements are counted over
  `placement.retry_window_s`, and the `generator_retries`-th within the window fails the run;
- a learner node that ended in failure fails its attempt: the other nodes are cancelled and a
  new attempt (every node, resuming from the last committed checkpoint) starts while
  `learner_retries` last; after that the run fails; the evaluator has one restart;
- when every learner node completed (the learner wrote the stop marker), the generators flush
  and end; what still runs after `FINISH_GRACE_S` is cancelled;
- `<run>/control/fleet.json` (`streamrl scale`) sets how many generators run: more are started
  (new indexes), the newest are asked to stop through their own stop marker (they flush their
  open segment first, then their runs complete).

Failing for good, or an interrupted parent (cancelled, Ctrl-C), writes the stop marker and
cancels every child still running (Prefect's server also cancels the children of a cancelled
flow run).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
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

from storage.control import (
    clear_stop,
    request_stop,
    requested_generators,
    set_requested_generators,
    stop_requested,
)
from streamrl.config import RunConfig
from streamrl.launch import claim_generator_index, reserve_generator_indexes
from streamrl.placement import Component as Kind
from streamrl.runs import open_run_location
from streamrl.supervisor import FINISH_GRACE_S, ComponentFailedError, RestartBudget

__all__ = ["PoolError", "PoolSupervisor", "job_variables"]

log = logging.getLogger(__name__)

# The flow each kind of process runs as (flows/learner.py, flows/generator.py, flows/evaluator.py).
FLOWS: dict[Kind, str] = {"learner": "learner", "generator": "generator", "evaluator": "evaluator"}
# `prefect deploy -n` names a deployment of deploy/prefect.yaml by its entrypoint's function
# (the deployment is then `<flow>/default`).
_ENTRYPOINTS: dict[Kind, str] = {
    "learner": "learner_node",
    "generator": "join_run",
    "evaluator": "evaluate_run",
}
_POOL_FIELDS: dict[Kind, str] = {
    "learner": "placement.learner_pool",
    "generator": "placement.generator_pool",
    "evaluator": "placement.eval_pool",
}
_NOT_STARTED = {StateType.SCHEDULED, StateType.PENDING, StateType.PAUSED}


class PoolError(RuntimeError):
    """A work pool cannot run what the run places on it; the message names the fix."""


@dataclass
class Child:
    """One flow run of the run's processes."""

    name: str  # learner, learner-node1, gen3, eval
    kind: Kind
    parameters: dict[str, Any]
    flow_run_id: UUID
    state: StateType | None = None
    message: str = ""
    stopping: bool = False  # asked to stop (scaling in, finishing): its end is expected

    @property
    def ended(self) -> bool:
        return self.state is not None and self.state in _FINAL

    @property
    def completed(self) -> bool:
        return self.state == StateType.COMPLETED


_FINAL = {StateType.COMPLETED, StateType.FAILED, StateType.CRASHED, StateType.CANCELLED}


def job_variables(config: RunConfig, kind: Kind, declared: set[str]) -> dict[str, Any]:
    """The job variables a flow run of `kind` gets on a pool whose template declares
    `declared`: `gpu_count` (the learner's ranks per node, or an engine's GPUs; 0 on CPU),
    `image` and `env` from `placement`. Variables the pool does not declare are left out."""
    if kind == "learner":
        gpus = 0 if config.learner.device == "cpu" else config.learner.nproc_per_node
    else:
        gpus = 0 if config.generator.device == "cpu" else config.generator.tensor_parallel_size
    wanted: dict[str, Any] = {"gpu_count": gpus}
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
    done); `abort(reason)` when interrupted."""

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
        self.generator_retries = generator_retries
        self.with_eval = evaluator and config.eval.every_versions > 0
        self.learner_attempts = RestartBudget(learner_retries)
        self.eval_restarts = RestartBudget(1)
        self.gen_restarts: dict[int, RestartBudget] = {}
        self.children: list[Child] = []
        self.failure: str | None = None
        self.finishing_since: float | None = None
        self.attempt = ""
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
        self.targets = {kind: self._target(kind, pool) for kind, pool in pools.items()}
        reserve_generator_indexes(self.run, self.generators, "streamrl flow (pools)")
        set_requested_generators(self.run, self.generators)
        self._start_learner()
        for index in range(self.generators):
            self._start_generator(index)
        if self.with_eval:
            self._launch("evaluator", "eval", {"run_uri": self.config.storage.run_uri})

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

    def _launch(self, kind: Kind, name: str, parameters: dict[str, Any]) -> Child:
        target = self.targets[kind]
        variables = job_variables(self.config, kind, target.declared)
        flow_run = run_deployment(
            target.deployment_id,
            parameters=parameters,
            flow_run_name=f"{self.config.run_name}-{name}",
            timeout=0,
            job_variables=variables or None,
            tags=["streamrl", kind],
        )
        child = Child(name, kind, parameters, flow_run.id, flow_run.state_type)
        self.children.append(child)
        self.log.info("started %s: flow run %s on pool '%s'", name, flow_run.name, target.pool)
        return child

    def _start_learner(self) -> None:
        nnodes = self.config.learner.nnodes
        self.attempt = uuid.uuid4().hex[:12]
        for node in range(nnodes):
            name = "learner" if nnodes == 1 else f"learner-node{node}"
            parameters = {
                "run_uri": self.config.storage.run_uri,
                "node_rank": node,
                "attempt": self.attempt,
            }
            self._launch("learner", name, parameters)

    def _start_generator(self, index: int) -> None:
        clear_stop(self.run, writer=f"gen{index}")  # a stopped index may run again
        self.gen_restarts.setdefault(
            index, RestartBudget(self.generator_retries, self.config.placement.retry_window_s)
        )
        parameters = {"run_uri": self.config.storage.run_uri, "index": index, "retries": 0}
        self._launch("generator", f"gen{index}", parameters)

    # -- watching ---------------------------------------------------------------------------

    def live(self, kind: Kind | None = None) -> list[Child]:
        return [c for c in self.children if not c.ended and (kind is None or c.kind == kind)]

    def poll(self) -> bool:
        """Read the children's states and act on what ended; True when the run is done.
        Raises `ComponentFailedError` (after cancelling every child) when it failed for good."""
        self._refresh()
        now = self.clock()
        learner = [c for c in self.children if c.kind == "learner" and c.parameters.get(
            "attempt") == self.attempt]  # fmt: skip
        if self.finishing_since is None and learner and all(c.completed for c in learner):
            self.log.info("the learner completed; the generators flush and stop")
            self.finishing_since = now
            for child in self.live():
                child.stopping = True
        if self.finishing_since is not None:
            leftover = self.live()
            if not leftover:
                return True
            if now - self.finishing_since > FINISH_GRACE_S:
                self._cancel(leftover, f"still running {FINISH_GRACE_S:.0f}s after the learner")
                return True
            return False
        for child in [c for c in self.children if c.ended and not c.stopping]:
            child.stopping = True  # handled once
            if child.kind == "learner" and not child.completed:
                self._learner_failed(child, now)
            elif child.kind == "generator":
                self._generator_ended(child, now)
            elif child.kind == "evaluator" and not child.completed:
                self._evaluator_failed(child, now)
        self._scale()
        return False

    def _refresh(self) -> None:
        waiting = [c for c in self.children if not c.ended]
        if not waiting:
            return
        runs = self.client.read_flow_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[c.flow_run_id for c in waiting]))
        )
        by_id = {run.id: run for run in runs}
        for child in waiting:
            run = by_id.get(child.flow_run_id)
            if run is not None and run.state is not None:
                child.state, child.message = run.state.type, run.state.message or ""

    def _describe(self, child: Child) -> str:
        state = child.state.value.lower() if child.state else "unknown"
        return f"{child.name} ({state}{': ' + child.message if child.message else ''})"

    def _learner_failed(self, child: Child, now: float) -> None:
        others = [c for c in self.live("learner") if c.parameters["attempt"] == self.attempt]
        self._cancel(others, f"{child.name} of the same learner attempt ended")
        if not self.learner_attempts.spend(now):
            self._fail(f"the learner failed for good: {self._describe(child)}")
        self.log.warning(
            "%s; learner attempt %d of %d resumes from the last checkpoint",
            self._describe(child), self.learner_attempts.total, self.learner_attempts.allowed,
        )  # fmt: skip
        self._start_learner()

    def _generator_ended(self, child: Child, now: float) -> None:
        index = int(child.parameters["index"])
        if stop_requested(self.run, child.name):
            return  # scaled in, or the run is stopping
        budget = self.gen_restarts[index]
        if not budget.spend(now):
            self._fail(
                f"{child.name} failed for good ({budget.allowed} replacements within "
                f"{self.config.placement.retry_window_s:.0f}s): {self._describe(child)}"
            )
        self.log.warning(
            "%s; replaced (replacement %d, %d within placement.retry_window_s)",
            self._describe(child), budget.total, len(budget.times),
        )  # fmt: skip
        self._start_generator(index)

    def _evaluator_failed(self, child: Child, now: float) -> None:
        if not self.eval_restarts.spend(now):
            self._fail(f"the evaluator failed for good: {self._describe(child)}")
        self.log.warning("%s; restarted", self._describe(child))
        self._launch("evaluator", "eval", child.parameters)

    def _scale(self) -> None:
        wanted = requested_generators(self.run)
        running = [c for c in self.live("generator") if not c.stopping]
        if wanted is None or wanted == len(running):
            return
        if wanted > len(running):
            for _ in range(wanted - len(running)):
                index = claim_generator_index(self.run, owner="streamrl flow (pools)")
                self.log.info("scaling out to %d generators: gen%d", wanted, index)
                self._start_generator(index)
            return
        newest = sorted(running, key=lambda c: int(c.parameters["index"]))[wanted:]
        for child in newest:
            self.log.info("scaling in to %d generators: %s flushes and stops", wanted, child.name)
            request_stop(self.run, f"scaled in to {wanted} generators", writer=child.name)
            child.stopping = True

    # -- stopping ---------------------------------------------------------------------------

    def _cancel(self, children: list[Child], reason: str) -> None:
        for child in children:
            child.stopping = True
            state = Cancelled if child.state in _NOT_STARTED else Cancelling
            try:
                self.client.set_flow_run_state(child.flow_run_id, state(message=reason), force=True)
                if state is Cancelled:  # it never started: ended now
                    child.state = StateType.CANCELLED
            except Exception as exc:  # the server unreachable: Prefect's own cleanup remains
                self.log.warning("could not cancel %s: %r", child.name, exc)

    def _fail(self, reason: str) -> None:
        self.failure = reason
        self.abort(reason)
        raise ComponentFailedError(reason)

    def abort(self, reason: str) -> None:
        """Stop the run: its stop marker, then every child still running is cancelled."""
        try:
            request_stop(self.run, reason)
        except OSError as exc:
            self.log.warning("could not write the run's stop marker: %r", exc)
        self._refresh()
        self._cancel(self.live(), reason)

    def restarts(self) -> dict[str, int]:
        counts = {f"gen{i}": w.total for i, w in self.gen_restarts.items() if w.total}
        if self.learner_attempts.total:
            counts["learner"] = self.learner_attempts.total
        if self.eval_restarts.total:
            counts["eval"] = self.eval_restarts.total
        return counts
