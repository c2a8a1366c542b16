"""The Prefect task that runs one component of a run — learner, generator or evaluator — under the
supervision core (`streamrl.supervision.supervisor.Supervisor.keep_running`), and `run_alone`, the
body of the flows that run one component on a work pool (`flows.generator`, `flows.learner`,
`flows.evaluator`).

A task run is the component's whole life: the core restarts it after a crash while its
restarts last (the learner resumes from its checkpoint, a generator continues its prompts) and
logs each restart as a warning of the task run; the task fails when the component failed for
good, with the reason. The task run's log shows what a terminal would (the learner's step
lines, streamrl's warnings and errors); everything a process prints is in its log file
(`Supervisor.logs`).
"""

from __future__ import annotations

import logging
import socket

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from storage.fs import StorageError, open_location
from streamrl.config.run import RunConfig
from streamrl.config.stored import open_existing_run
from streamrl.supervision.output import STEP_LINE, noteworthy
from streamrl.supervision.policy import NOT_RESTARTED
from streamrl.supervision.supervisor import Component, Supervisor

__all__ = ["component_task", "open_run_config", "run_alone"]


@task(name="component", task_run_name="{name}", retries=0, cache_policy=NO_CACHE)
def component_task(supervisor: Supervisor, name: str) -> None:
    """Keep component `name` of `supervisor`'s run running until it is done (or failed for
    good: raises `ComponentFailedError`)."""
    logger = get_run_logger()
    component: Component = next(c for c in supervisor.components if c.name == name)

    def on_line(line: str) -> None:
        if (shown := noteworthy(line)) is not None:
            level, _, message = shown.partition(": ")
            if level in ("WARNING", "ERROR", "CRITICAL"):
                logger.log(logging.getLevelName(level), "%s", message)
            elif STEP_LINE.match(shown):
                logger.info("%s", shown)
            else:  # a progress line before the first step: whose it is
                logger.info("[%s] %s", name, shown)

    supervisor.keep_running(component, on_line)
    logger.info("%s exited with code %s", name, component.exit_code)


def open_run_config(run_uri: str) -> RunConfig:
    """The configuration of the existing run at `run_uri`, as this worker reaches it.

    A run on local disk that this machine does not have was most likely made on another one (a
    run placed on work pools whose flow runs land in containers or on other nodes): the error
    says its storage has to be shared, and that a restart would fail the same way (the parent
    of a run on pools then fails the run at once)."""
    location = open_location(run_uri, check=False)
    if location.is_local and not location.fs.exists(location.path):
        raise StorageError(
            f"no run at {run_uri} on this machine ({socket.gethostname()}): the run was made on "
            "another machine's disk, which this flow run does not see. The processes of a run "
            "on several machines (work pools of containers or nodes) share only its storage: "
            f"give the run an s3:// run URI (or a path every machine mounts); {NOT_RESTARTED}"
        )
    config, _ = open_existing_run(run_uri)
    config.storage.run_uri = run_uri
    return config


def run_alone(supervisor: Supervisor) -> None:
    """Run the one component of `supervisor` (`Supervisor.for_component`) as a task of this
    flow run; whatever ends the flow run (the component's end, cancellation, SIGTERM) stops
    its process."""
    (component,) = supervisor.components
    placement = component.placement
    cores = list(placement.cpus) if placement else "inherited"
    get_run_logger().info(
        "%s of %s on cores %s, GPUs %s; output in %s", component.name,
        supervisor.config.storage.run_uri, cores,
        ",".join(placement.gpus) if placement and placement.gpus else "none",
        supervisor.logs.folder,
    )  # fmt: skip
    try:
        component_task(supervisor, component.name)
    finally:
        supervisor.abort(f"the {component.name} flow run ended")  # stops only this process
        supervisor.finish()
