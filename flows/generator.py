"""The `generator` flow: one more generator for an existing run, on any work pool, any time.

    prefect deployment run generator/default -p run_uri=s3://bucket/runs/x

It claims the run's next free generator index (or uses `index`), then generates until the
run's stop marker appears, on this worker's cores and first `tensor_parallel_size` GPUs
(`streamrl.placement.place_joining_generator`). A crash is restarted by the supervision core
(a fresh incarnation of the same writer; a preempted generator loses at most its open
segment); one that fails for good fails this flow run, not the run it joined.
"""

from __future__ import annotations

import socket

from prefect import flow, get_run_logger

from flows.components import component_task
from storage.fs import open_location
from streamrl.launch import claim_generator_index
from streamrl.runs import load_run_config
from streamrl.supervisor import Supervisor

__all__ = ["join_run"]


@flow(name="generator", log_prints=True)
def join_run(run_uri: str, index: int | None = None, retries: int = 3) -> int:
    """Generate for the run at `run_uri` until it stops; returns the generator index used."""
    logger = get_run_logger()
    run = open_location(run_uri)
    config = load_run_config(run)
    config.storage.run_uri = run_uri  # the run as this worker reaches it
    if index is None:
        index = claim_generator_index(run, first=config.generator.count, owner=socket.gethostname())
    supervisor = Supervisor.for_joining_generator(config, index, max_restarts=retries)
    (component,) = supervisor.components
    logger.info("joining %s as generator %d on cores %s; output in %s", run_uri, index,
                list(component.placement.cpus), supervisor.logs.folder)  # fmt: skip
    try:
        component_task(supervisor, component.name)
    finally:
        supervisor.abort("the generator flow run ended")  # stops only this generator
        supervisor.logs.close()
    return index
