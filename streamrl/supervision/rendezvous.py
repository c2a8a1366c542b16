"""How the nodes of a multi-node learner find each other: through the run's storage only.

Each attempt of a learner of `learner.nnodes` nodes has an id (the flow that starts the nodes
picks a fresh one per attempt). Node 0 picks a free port on its machine and publishes its
address as `<run>/control/rendezvous/<attempt>.json`; every other node waits for that object
and then joins torchrun's static rendezvous there (`--master-addr/--master-port`, node 0's
agent hosting the store). Nothing but the run's storage is shared, and an address of an
earlier attempt is never read by a later one.

The address node 0 publishes is `STREAMRL_NODE_ADDRESS` when set (a pod IP from the Downward
API, or 127.0.0.1 for nodes on one machine), else the address its host name resolves to (a
pod's own IP on Kubernetes).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass

from storage.fs import Location

__all__ = [
    "ADDRESS_VARIABLE",
    "LearnerNode",
    "RendezvousTimeoutError",
    "await_node0",
    "publish_node0",
]

ADDRESS_VARIABLE = "STREAMRL_NODE_ADDRESS"
POLL_S = 1.0


class RendezvousTimeoutError(TimeoutError):
    """Node 0 of a learner attempt did not publish its address in time."""


@dataclass(frozen=True)
class LearnerNode:
    """This node's place in a learner of `nnodes` nodes and where node 0's store listens."""

    nnodes: int
    node_rank: int
    address: str
    port: int

    def torchrun_args(self) -> list[str]:
        return [
            f"--nnodes={self.nnodes}",
            f"--node-rank={self.node_rank}",
            f"--master-addr={self.address}",
            f"--master-port={self.port}",
        ]


def _record(run: Location, attempt: str) -> str:
    return run.join("control", "rendezvous", f"{attempt}.json")


def node_address() -> str:
    """The address other nodes reach this one at (see the module docstring)."""
    return os.environ.get(ADDRESS_VARIABLE) or socket.gethostbyname(socket.gethostname())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def publish_node0(run: Location, attempt: str, nnodes: int) -> LearnerNode:
    """On node 0: pick a free port, publish this machine's address for `attempt`, and return
    node 0's place."""
    node = LearnerNode(nnodes, 0, node_address(), _free_port())
    record = {"address": node.address, "port": node.port, "nnodes": nnodes, "at": time.time()}
    if run.is_local:
        run.fs.makedirs(run.join("control", "rendezvous"), exist_ok=True)
    run.fs.pipe_file(_record(run, attempt), json.dumps(record).encode())
    return node


def await_node0(
    run: Location, attempt: str, node_rank: int, nnodes: int, timeout_s: float
) -> LearnerNode:
    """On node `node_rank` > 0: wait until node 0 published its address for `attempt`.
    Raises `RendezvousTimeoutError` after `timeout_s`."""
    path, deadline = _record(run, attempt), time.monotonic() + timeout_s
    while True:
        try:
            record = json.loads(run.fs.cat_file(path))
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise RendezvousTimeoutError(
                    f"node 0 of learner attempt {attempt} published no address in "
                    f"{timeout_s:.0f}s ({run.uri}/control/rendezvous/{attempt}.json); is its "
                    "flow run on placement.learner_pool running? (learner.rendezvous_timeout_s)"
                ) from None
            time.sleep(POLL_S)
            continue
        if record["nnodes"] != nnodes:
            raise ValueError(
                f"node 0 of attempt {attempt} expects {record['nnodes']} nodes, this node "
                f"{nnodes}: every node must read the same run configuration"
            )
        return LearnerNode(nnodes, node_rank, record["address"], int(record["port"]))
