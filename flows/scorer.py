"""The `scorer` flow: one of a run's served scorers (a teacher, reward model or judge: vLLM's
OpenAI-compatible server, `streamrl scorer`) as a flow run of its own, started on
`placement.scorer_pool` by a run placed on work pools (`flows.pools`).

It serves until the run's supervisor cancels it (the run finished, or stopped), on this worker's
cores and first `tensor_parallel_size` GPUs, listening on every interface and publishing this
machine's name in the run's storage (`streamrl.scorers.serve`): the generators' machines must
reach it there. Restarting it is the parent's job.
"""

from __future__ import annotations

from prefect import flow

from flows.components import open_run_config, run_alone
from streamrl.supervision.supervisor import Supervisor

__all__ = ["serve_scorer"]


@flow(name="scorer", log_prints=True)
def serve_scorer(run_uri: str, index: int) -> None:
    """Serve scorer `index` (of the run's served scorers, by name) of the run at `run_uri`."""
    run_alone(Supervisor.for_component(open_run_config(run_uri), "scorer", index))
