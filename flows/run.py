"""The `streamrl` flow: one RL run — learner, generators, evaluator — started and supervised.

    prefect deployment run streamrl/dapo --watch
    prefect deployment run streamrl/dapo -p generators=4 -p 'overrides=["learner.total_steps=500"]'

Parameters: `preset` (an algorithm preset: dapo, vapo, grpo, ...), `size` (a size preset such
as smollm2-cpu or qwen2.5-7b-dapo), `extra_presets` (layered after `size`: an environment such as
calculator, `lora`), `config_file`, `overrides` (dotted, `learner.lr=1e-6`),
`run_uri` (default: the configuration's, else a fresh ./runs/<preset>-<time>), `generators`
(default: generator.count), `resume`, `generator_retries`, `learner_retries`.

Where the processes run is `placement.mode`. `pools` (`-p 'overrides=["placement.mode=pools"]'`):
each is its own flow run on a work pool, a child of this one (`flows.pools`; scale with
`streamrl scale RUN_URI --generators N` or the `scale` flow). `local` (the default), below.

Supervision is `streamrl.supervision.supervisor.Supervisor`, the core `streamrl run` uses too: each
component is a task run (`flows.components.component_task`) for its whole life, restarts included
(the learner resumes from its checkpoint). When the learner reaches its step budget it writes the
run's stop marker; the generators flush and exit, and the flow run completes. When a component fails
for good, the core stops the others and the flow fails with that component's reason: never Completed
over a failure. An interrupted flow (Ctrl-C, cancellation) stops every process of the run before it
ends. Artifacts: progress (steps / total), a table of the latest metrics refreshed as steps arrive,
and the wandb link.
"""

# No `from __future__ import annotations` here: the flow's parameter annotations must be objects,
# not strings, for Prefect to validate a deployment run's parameters (`Override`'s schema).
import logging
import re
import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.futures import PrefectFuture

from flows.artifacts import RunArtifacts
from flows.components import component_task
from flows.pools import PoolSupervisor
from storage.fs import Location
from streamrl.config.loading import Override, load_config
from streamrl.config.run import RunConfig, StorageConfig
from streamrl.config.stored import open_run_location, prepare_run
from streamrl.envs.prerequisites import check_prerequisites
from streamrl.isolation.user_code import check_user_code
from streamrl.placement import PlacementPlan, PoolsPlacement, plan_placement
from streamrl.runs.health import HealthWatch
from streamrl.supervision.signals import stopping_despite_interrupts
from streamrl.supervision.supervisor import ComponentFailedError, Supervisor

__all__ = ["streamrl_run", "supervise", "supervise_on_pools"]

REFRESH_S = 5.0
_DIGITS = re.compile(r"\d+(?:\.\d+)?")


def _failed(future: PrefectFuture[Any]) -> bool:
    state = future.state
    return state.is_final() and not state.is_completed()


def supervise(
    config: RunConfig,
    *,
    generators: int,
    retries: int = 3,
    learner_retries: int = 1,
    evaluate: bool = True,
    placement: PlacementPlan | None = None,
) -> dict[str, Any]:
    """Start the run's components as tasks and watch them until the learner is done.

    Every process starts from `placement` (default: `plan_placement` for this machine), logged
    once and stored as `<run>/control/placement.json`; `retries` restarts per generator.
    Returns a summary (steps, restarts, last metrics); raises `ComponentFailedError` after
    stopping everything when a component failed for good."""
    logger = get_run_logger()
    supervisor = Supervisor.for_run(
        config,
        generators=generators,
        placement=placement,
        evaluator=evaluate,
        max_restarts=retries,
        learner_restarts=learner_retries,
        owner="streamrl flow",
    )
    logger.info("%s", supervisor.plan.describe())
    logger.info("each process's output: %s", supervisor.logs.folder)
    supervisor.prepare()
    artifacts = RunArtifacts(config, supervisor.run_location)
    futures = {c.name: component_task.submit(supervisor, c.name) for c in supervisor.components}
    try:
        while not futures["learner"].state.is_final():
            _look(artifacts, None, logger)  # the learner's warnings come with its lines
            if any(_failed(f) for f in futures.values()):
                break
            time.sleep(REFRESH_S)
    except BaseException:  # Ctrl-C, a cancelled flow run: nothing of the run keeps running
        with stopping_despite_interrupts(config.learner.stop_grace_s):
            supervisor.abort("interrupted (Ctrl-C, or the flow run was stopped)", interrupted=True)
            _wait(futures)
            supervisor.finish()
        raise
    _wait(futures)
    supervisor.finish()
    latest = artifacts.refresh(final=True)
    if supervisor.failures:
        logger.error("%s; the run was stopped", supervisor.failures[0].splitlines()[0])
        raise ComponentFailedError("; ".join(supervisor.failures))
    restarts = {c.name: c.restarts for c in supervisor.components if c.restarts}
    return _summary(config, latest, restarts)


def supervise_on_pools(
    config: RunConfig,
    *,
    generators: int,
    retries: int = 3,
    learner_retries: int = 1,
    evaluate: bool = True,
) -> dict[str, Any]:
    """`placement.mode: pools`: the learner, generators and evaluator as child flow runs on
    their work pools (`flows.pools.PoolSupervisor`), watched until the learner is done.
    `retries`: replacements per generator within `placement.retry_window_s`;
    `learner_retries`: learner attempts after the first. Returns a summary as `supervise`
    does; raises `ComponentFailedError` after cancelling every child when one failed for good."""
    logger = get_run_logger()
    artifacts = RunArtifacts(config, open_run_location(config))
    health = HealthLog(artifacts.run, logger)
    with get_client(sync_client=True) as client:
        fleet = PoolSupervisor(
            config,
            client,
            generators=generators,
            generator_retries=retries,
            learner_retries=learner_retries,
            evaluator=evaluate,
            logger=logger,
        )
        try:
            fleet.start()
            while not fleet.poll():
                _look(artifacts, health, logger)
                time.sleep(REFRESH_S)
        except ComponentFailedError as failed:
            artifacts.refresh(final=True)
            logger.error("%s; the run was stopped", str(failed).splitlines()[0])
            raise
        except BaseException:  # Ctrl-C, the flow run cancelled or crashed: the children end too
            with stopping_despite_interrupts(config.learner.stop_grace_s):
                fleet.abort("the streamrl flow run was interrupted (cancelled, Ctrl-C)")
            raise
    return _summary(config, artifacts.refresh(final=True), fleet.restarts())


def _look(
    artifacts: RunArtifacts, health: "HealthLog | None", logger: logging.LoggerAdapter
) -> None:
    """The artifacts and the health log (None: the learner's own lines reach this flow's log),
    refreshed. Both are for people to look at: a failure (storage unreachable for a moment) is
    logged and the run goes on — it must never reach the handler that stops the run."""
    try:
        artifacts.refresh()
    except Exception as exc:
        logger.warning("could not refresh the run's artifacts (tried again in %.0f s): %r",
                       REFRESH_S, exc)  # fmt: skip
    if health is not None:
        health.refresh()


class HealthLog:
    """The run's health warnings (`streamrl.runs.health`: a learner starved by dynamic sampling,
    the learner's health conditions) in this flow run's log, each once as it appears, for a run
    on work pools: they are otherwise only in the learner's own log (a container's). A run this
    flow supervises forwards the learner's warnings with its lines: it needs no second copy."""

    def __init__(self, run: Location, logger: logging.Logger | logging.LoggerAdapter) -> None:
        self.watch, self.logger = HealthWatch(run), logger
        self.shown: set[str] = set()

    def refresh(self) -> None:
        try:
            warnings = self.watch.read()
        except Exception as exc:  # advisory: storage unreachable now, the next refresh retries
            self.logger.debug("health warnings unreadable: %r", exc)
            return
        # A warning's counts grow while it lasts ("no signal in the last 64 groups", then 128):
        # one line for it, and another once it went away and came back.
        current = {_DIGITS.sub("#", warning): warning for warning in warnings}
        for shape, warning in current.items():
            if shape not in self.shown:
                self.logger.warning("%s", warning)
        self.shown = set(current)


def _summary(
    config: RunConfig, latest: dict[str, Any] | None, restarts: dict[str, int]
) -> dict[str, Any]:
    summary = {
        "run_uri": config.storage.run_uri,
        "steps": int(latest["step"]) if latest else 0,
        "restarts": restarts,
        "last_metrics": latest,
    }
    get_run_logger().info(
        "run complete: %s, %d steps, restarts %s",
        summary["run_uri"],
        summary["steps"],
        summary["restarts"] or "none",
    )
    return summary


def _wait(futures: dict[str, PrefectFuture[Any]]) -> None:
    """Until every component's task run has ended (their processes with them)."""
    for future in futures.values():
        future.wait()


@flow(name="streamrl", log_prints=True)
def streamrl_run(
    preset: str = "dapo",
    size: str | None = "smollm2-cpu",
    extra_presets: list[str] | None = None,
    config_file: str | None = None,
    overrides: list[Override] | None = None,
    run_uri: str | None = None,
    generators: int | None = None,
    resume: bool = False,
    generator_retries: int = 3,
    learner_retries: int = 1,
    allow_trusted_changes: bool = False,
) -> dict[str, Any]:
    """Run (or resume) a streamrl run to its step budget: its processes on this machine
    (`placement.mode=local`) or each its own flow run on a work pool (`pools`).
    `allow_trusted_changes`: a resume may change what decides where code runs or what it
    trusts (the reward function, the model, the storage endpoint, placement.env; see
    `streamrl.config.stored.prepare_run`)."""
    extra = list(overrides or [])
    if run_uri:
        extra.append(f"storage.run_uri={run_uri}")
    presets = [preset, *([size] if size else []), *(extra_presets or [])]
    config = load_config(presets, config_file, extra)
    if config.storage.run_uri == StorageConfig().run_uri and not resume:  # a fresh run each time
        config.storage.run_uri = f"./runs/{preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    count = config.generators_to_start(generators)
    if isinstance(config.placement, PoolsPlacement):
        config, _ = prepare_run(config, resume=resume, allow_trusted_changes=allow_trusted_changes)
        return supervise_on_pools(
            config, generators=count, retries=generator_retries, learner_retries=learner_retries
        )
    placement = plan_placement(config, generators=count)  # refused before anything starts
    check_user_code(config.user_code)  # its processes import the user's code here
    check_prerequisites(config.data, config.generator.env)  # and the ecosystems' packages
    config, _ = prepare_run(config, resume=resume, allow_trusted_changes=allow_trusted_changes)
    return supervise(
        config,
        generators=count,
        retries=generator_retries,
        learner_retries=learner_retries,
        placement=placement,
    )
