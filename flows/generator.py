"""The `generator` flow: one generator of a run, on any work pool, any time.

    prefect deployment run generator/default -p run_uri=s3://bucket/runs/x

By hand, it joins a running run: it claims the run's next free generator index (or uses
`index`) and generates until the run's stop marker (or its own, `streamrl scale`) appears, on
this worker's cores and first `tensor_parallel_size` GPUs (`streamrl.placement.place_alone`).
A crash is restarted `retries` times by the supervision core (a fresh incarnation of the same
writer; a preempted generator loses at most its open segment); one that fails for good fails
this flow run, not the run it joined. A run placed on work pools (`flows.pools`) starts its
generators as runs of this flow with `retries=0`: their replacement is the parent's.
"""

from __future__ import annotations

import socket

from prefect import flow

from flows.components import open_run_config, run_alone
from streamrl.config.stored import open_run_location
from streamrl.generator.index import claim_generator_index
from streamrl.supervision.supervisor import Supervisor

__all__ = ["join_run"]


@flow(name="generator", log_prints=True)
def join_run(run_uri: str, index: int | None = None, retries: int = 3) -> int:
    """Generate for the run at `run_uri` until it stops; returns the generator index used."""
    config = open_run_config(run_uri)
    if index is None:
        run = open_run_location(config)
        index = claim_generator_index(run, first=config.generator.count, owner=socket.gethostname())
    run_alone(Supervisor.for_component(config, "generator", index, max_restarts=retries))
    return index
