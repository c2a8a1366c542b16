"""Prefect tasks that run one streamrl process each: the learner, a generator, the evaluator.

A task run is one process lifetime: its output lines go to the task run's logger (streamrl's
own lines, warnings and errors at INFO; the engines' chatter at DEBUG), a non-zero
exit fails the attempt, and Prefect's retries restart it (a generator resumes writing with a
fresh incarnation; the learner resumes from its latest checkpoint). `stop_event(run_uri)` is
the per-run switch the supervising flow sets to stop every process of a run (SIGTERM, then
SIGKILL after a grace period). Restarts are counted per run for the flow's artifacts.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import Counter

from prefect import get_run_logger, task
from prefect.runtime import task_run

from streamrl.config import RunConfig
from streamrl.launch import (
    evaluator_command,
    generator_command,
    learner_command,
    run_process,
)
from streamrl.placement import ProcessPlacement

__all__ = ["evaluator_task", "generator_task", "learner_task", "restarts", "stop_event"]

# Lines a user follows at INFO: streamrl's own log lines, warnings, errors and what comes
# with them; the engines' chatter (vLLM start-up, progress bars) goes to DEBUG.
_NOTEWORTHY = re.compile(r" streamrl\.| (WARNING|ERROR|CRITICAL) |Traceback|Error|^\S+: ")

_stops: dict[str, threading.Event] = {}
_restarts: dict[str, Counter[str]] = {}
_lock = threading.Lock()


def stop_event(run_uri: str) -> threading.Event:
    """The event that stops every process this flow process runs for `run_uri`."""
    with _lock:
        return _stops.setdefault(run_uri, threading.Event())


def restarts(run_uri: str) -> Counter[str]:
    """Restarts so far per component name of `run_uri` (this flow process)."""
    with _lock:
        return _restarts.setdefault(run_uri, Counter())


class ComponentExitError(RuntimeError):
    """A component's process exited with a non-zero code (one attempt of its task)."""


def _run(name: str, argv: list[str], run_uri: str, placement: ProcessPlacement | None) -> None:
    logger = get_run_logger()
    attempt = task_run.run_count
    if attempt > 1:
        restarts(run_uri)[name] += 1
        logger.warning("restarting %s (attempt %d)", name, attempt)
    stop = stop_event(run_uri)
    if stop.is_set():
        logger.info("%s not started: the run is stopping", name)
        return
    tail: list[str] = []

    def on_line(line: str) -> None:
        tail[:] = [*tail[-19:], line]
        level = logging.INFO if _NOTEWORTHY.search(line) else logging.DEBUG
        logger.log(level, "[%s] %s", name, line)

    code = run_process(argv, on_line, stop, placement=placement)
    if code != 0 and not stop.is_set():
        last = "\n".join(tail[-10:])
        raise ComponentExitError(f"{name} exited with code {code}; its last lines:\n{last}")
    logger.info("%s exited with code %d", name, code)


@task(name="learner", task_run_name="learner", retries=1, retry_delay_seconds=2)
def learner_task(config: RunConfig, placement: ProcessPlacement | None = None) -> None:
    """The learner (torchrun when it has several ranks) until its step budget, on its
    `placement`'s cores and GPUs (None: the worker's own environment)."""
    _run("learner", learner_command(config), config.storage.run_uri, placement)


@task(name="generator", task_run_name="generator-{index}", retries=3, retry_delay_seconds=2)
def generator_task(
    config: RunConfig, index: int, placement: ProcessPlacement | None = None
) -> None:
    """Generator `index` until the run's stop marker, on its `placement` (as the learner's)."""
    _run(f"gen{index}", generator_command(config, index), config.storage.run_uri, placement)


@task(name="evaluator", task_run_name="evaluator", retries=1, retry_delay_seconds=2)
def evaluator_task(config: RunConfig, placement: ProcessPlacement | None = None) -> None:
    """Held-out evaluation of every E-th published version, until the run stops, on its
    `placement` (as the learner's)."""
    _run("eval", evaluator_command(config), config.storage.run_uri, placement)
