"""The `learner` flow: one node of a run's learner (`streamrl learner`, under torchrun with
`learner.nproc_per_node` ranks), started on `placement.learner_pool` by a run placed on work
pools (`flows.pools`), one flow run per node.

With `learner.nnodes` > 1 the nodes of one attempt (the same `attempt` id) meet through the run's
storage (`streamrl.supervision.rendezvous`): node 0 publishes its address, the others wait for it
(up to `learner.rendezvous_timeout_s`) and join torchrun's rendezvous there. Every attempt resumes
from the run's last committed checkpoint; a node that dies fails its attempt, and the parent starts
the next one (`take_over`: once the earlier attempt's nodes have ended or are fenced, so the learner
takes the run's lease over at once). Restarting is the parent's job: this flow run fails with its
node.
"""

from __future__ import annotations

from prefect import flow

from flows.components import open_run_config, run_alone
from streamrl.config.stored import open_run_location
from streamrl.supervision.rendezvous import await_node0, publish_node0
from streamrl.supervision.supervisor import Supervisor

__all__ = ["learner_node"]


@flow(name="learner", log_prints=True)
def learner_node(
    run_uri: str, node_rank: int = 0, attempt: str | None = None, take_over: bool = False
) -> int:
    """Train the run at `run_uri` as node `node_rank` of attempt `attempt` until the learner
    reaches its step budget; returns the node rank. `take_over`: take the run's learner lease
    over from an earlier holder at once (`streamrl learner --take-over`)."""
    config = open_run_config(run_uri)
    nnodes = config.learner.nnodes
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank={node_rank} but the run's learner has {nnodes} node(s)")
    node = None
    if nnodes > 1:
        if not attempt:
            raise ValueError(
                f"the learner has {nnodes} nodes: pass `attempt`, the same id to every node of "
                "one attempt (the streamrl flow does)"
            )
        run = open_run_location(config)
        if node_rank == 0:
            node = publish_node0(run, attempt, nnodes)
        else:
            timeout = config.learner.rendezvous_timeout_s
            node = await_node0(run, attempt, node_rank, nnodes, timeout)
    run_alone(Supervisor.for_component(config, "learner", node=node, take_over=take_over))
    return node_rank
