"""The `evaluator` flow: a run's held-out evaluation (`streamrl eval --follow`) as a flow run of
its own, started on `placement.eval_pool` by a run placed on work pools (`flows.pools`).

It scores each published version the run's `eval` settings select until the run stops, on
this worker's cores and first `tensor_parallel_size` GPUs. Restarting it is the parent's job.
"""

from __future__ import annotations

from prefect import flow

from flows.components import open_run_config, run_alone
from streamrl.supervision.supervisor import Supervisor

__all__ = ["evaluate_run"]


@flow(name="evaluator", log_prints=True)
def evaluate_run(run_uri: str) -> None:
    """Evaluate the run at `run_uri`'s published versions until it stops."""
    run_alone(Supervisor.for_component(open_run_config(run_uri), "evaluator"))
