"""The `streamrl` flow: one RL run — learner, generators, evaluator — started and supervised.

    prefect deployment run streamrl/dapo --watch
    prefect deployment run streamrl/dapo -p generators=4 -p 'overrides=["learner.total_steps=500"]'

Parameters: `preset` (an algorithm preset: dapo, vapo, grpo, ...), `size` (a size preset such
as smollm2-cpu or qwen2.5-7b-dapo), `config_file`, `overrides` (dotted, `learner.lr=1e-6`),
`run_uri` (default: the configuration's, else a fresh ./runs/<preset>-<time>), `generators`
(default: generator.count), `resume`.

Supervision: the learner and each generator are tasks (one process per attempt; retries
restart them — the learner from its checkpoint). When the learner reaches its step budget it
writes the run's stop marker; the generators flush and exit, and the flow run completes. When
a component fails for good (retries spent), the flow stops the others and fails with that
component's reason: never Completed over a failure. Artifacts: progress (steps / total), a
table of the latest metrics refreshed as steps arrive, and the wandb link.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.futures import PrefectFuture

from flows.artifacts import RunArtifacts
from flows.components import (
    evaluator_task,
    generator_task,
    learner_task,
    restarts,
    stop_event,
)
from storage.control import request_stop, stop_requested
from streamrl.config import RunConfig, StorageConfig, load_config
from streamrl.launch import reserve_generator_indexes
from streamrl.placement import PlacementPlan, plan_placement, write_placement
from streamrl.runs import open_run_location, prepare_run

__all__ = ["streamrl_run", "supervise"]

REFRESH_S = 5.0


class RunFailedError(RuntimeError):
    """A component of the run failed for good; the message names it and why."""


def _failed(future: PrefectFuture[Any]) -> bool:
    state = future.state
    return state.is_final() and not state.is_completed()


def supervise(
    config: RunConfig,
    *,
    generators: int,
    retries: int = 3,
    evaluate: bool = True,
    placement: PlacementPlan | None = None,
) -> dict[str, Any]:
    """Start the run's components as tasks and watch them until the learner is done.

    Every process starts from `placement` (default: `plan_placement` for this machine), logged
    once and stored as `<run>/control/placement.json`. Returns a summary (steps, restarts, last
    metrics); raises `RunFailedError` after stopping everything when a component failed for
    good."""
    logger = get_run_logger()
    run_uri = config.storage.run_uri
    plan = placement or plan_placement(config, generators=generators, evaluator=evaluate)
    logger.info("%s", plan.describe())
    run = open_run_location(config)
    write_placement(run, plan)
    artifacts = RunArtifacts(config, run)
    reserve_generator_indexes(run, generators, owner="streamrl flow")
    learner = learner_task.submit(config, plan.learner)
    workers = {
        f"generator-{i}": generator_task.with_options(retries=retries).submit(config, i, placed)
        for i, placed in enumerate(plan.generators)
    }
    if plan.evaluator is not None:
        workers["evaluator"] = evaluator_task.submit(config, plan.evaluator)
    failure, shown = None, 0
    total = config.learner.total_steps
    while not learner.state.is_final():
        latest = artifacts.refresh()
        if latest is not None and int(latest["step"]) > shown:
            shown = int(latest["step"])
            logger.info(
                "step %d/%d  reward %+.3f  acc %.3f  len %.0f  staleness %.2f  %.0f tok/s  v%d",
                shown,
                total,
                latest["rollout/reward_mean"],
                latest["rollout/acc"],
                latest["rollout/response_len_mean"],
                latest["stream/staleness_mean"],
                latest["perf/learner_tokens_per_s"],
                latest["policy_version"],
            )
        for name, future in workers.items():
            if _failed(future):
                failure = f"{name} failed for good: {future.state.message}"
        if failure:
            break
        time.sleep(REFRESH_S)
    if failure is None and _failed(learner):
        failure = f"the learner failed for good: {learner.state.message}"
    if failure is not None:
        logger.error("%s; stopping the run", failure)
        if not stop_requested(run):
            request_stop(run, failure)
        stop_event(run_uri).set()
    for future in [learner, *workers.values()]:
        future.wait()
    latest = artifacts.refresh(final=True)
    if failure is not None:
        raise RunFailedError(failure)
    summary = {
        "run_uri": run_uri,
        "steps": int(latest["step"]) if latest else 0,
        "restarts": dict(restarts(run_uri)),
        "last_metrics": latest,
    }
    logger.info(
        "run complete: %s, %d steps, restarts %s", run_uri, summary["steps"], summary["restarts"]
    )
    return summary


@flow(name="streamrl", log_prints=True)
def streamrl_run(
    preset: str = "dapo",
    size: str = "smollm2-cpu",
    config_file: str | None = None,
    overrides: list[str] | None = None,
    run_uri: str | None = None,
    generators: int | None = None,
    resume: bool = False,
    generator_retries: int = 3,
) -> dict[str, Any]:
    """Run (or resume) a streamrl run to its step budget."""
    extra = list(overrides or [])
    if run_uri:
        extra.append(f"storage.run_uri={run_uri}")
    presets = [preset, size] if size else [preset]
    config = load_config(presets, config_file, extra)
    if config.storage.run_uri == StorageConfig().run_uri and not resume:  # a fresh run each time
        config.storage.run_uri = f"./runs/{preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    count = generators if generators is not None else config.generator.count
    placement = plan_placement(config, generators=count)  # refused before anything starts
    config, _ = prepare_run(config, resume=resume)
    return supervise(config, generators=count, retries=generator_retries, placement=placement)
