"""A learner of several nodes: two "nodes" (two torchrun jobs of one rank each, on this machine)
that meet through the run's storage (`streamrl.supervision.rendezvous`) train exactly as one node of
two ranks does on the same stream; a node whose node 0 never shows up fails clearly."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from storage.control.manifest import create_run
from storage.fs import Location, open_location
from storage.stream.writer import StreamWriter
from storage.weights.versions import WeightStore
from streamrl.config.loading import load_config
from streamrl.config.run import RunConfig
from streamrl.models import resolve_model_path
from streamrl.placement import machine_cpus
from streamrl.supervision.rendezvous import (
    ADDRESS_VARIABLE,
    LearnerNode,
    RendezvousTimeoutError,
    await_node0,
    publish_node0,
)
from streamrl.supervision.supervisor import Supervisor
from tests.stream_data import random_group

STEPS = 2


def _config(run_dir: Path, *overrides: str) -> RunConfig:
    return load_config(
        ["dapo", "tiny-cpu"],
        overrides=[
            f"storage.run_uri={run_dir}",
            f"learner.total_steps={STEPS}",
            "learner.batch_groups=4",
            "learner.mini_batch_groups=4",
            "learner.max_staleness=100",  # the pre-written stream is all version 0
            "learner.checkpoint_every=100",
            "generator.max_tokens=24",
            *overrides,
        ],
    )


def _create(config: RunConfig) -> Location:
    """The run of `config` (its run.json is what the learner reads) and the test's stream: the
    same groups, in the same segments, for every run."""
    run = open_location(config.storage.run_uri)
    create_run(run, config.model_dump(mode="json"))
    rng = np.random.default_rng(0)
    groups = [
        random_group(rng, prompt_id=f"p{i}", vocab=600, max_len=24, prompt_len=10)
        for i in range(24)
    ]
    writer = StreamWriter(run, "gen0")
    for start in range(0, len(groups), 6):
        writer.write(groups[start : start + 6])
    return run


def _train(config: RunConfig, node: LearnerNode | None, lines: list[str]) -> None:
    """One learner node, as the `learner` flow runs it: alone on this machine, to its end."""
    supervised = Supervisor.for_component(config, "learner", node=node)
    try:
        supervised.keep_running(supervised.components[0], lines.append)
    finally:
        supervised.logs.close()


def _trained(run: Location) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """The last published weights and every step's metrics."""
    store = WeightStore(run)
    assert store.versions() == list(range(1, STEPS + 1))
    weights, _ = store.load(store.latest_version())
    lines = Path(run.path, "metrics", "learner.jsonl").read_text().splitlines()
    return weights, [json.loads(line) for line in lines]


@pytest.mark.timeout(600)
@pytest.mark.skipif(len(machine_cpus()) < 2, reason="one core per rank: needs two")
def test_two_nodes_of_one_rank_train_exactly_as_one_node_of_two(tmp_path, monkeypatch):
    monkeypatch.setenv(ADDRESS_VARIABLE, "127.0.0.1")  # node 0's published address: loopback
    resolve_model_path("tiny-qwen2")  # build the bundled model once, before the ranks race
    first, second = machine_cpus()[:2]

    # The reference: one node of two ranks (torchrun --standalone), one core and thread each.
    single = _config(tmp_path / "single", "learner.nproc_per_node=2", "learner.cpu_cores=2")
    single_run = _create(single)
    single_lines: list[str] = []
    _train(single, None, single_lines)

    # Two nodes of one rank each, one core and thread each, meeting through the run's storage.
    # Both read the same run.json; only where this test places each node differs (one machine).
    nodes = _config(
        tmp_path / "nodes",
        "placement.mode=pools",
        "learner.nnodes=2",
        "learner.nproc_per_node=1",
        f"learner.cpu_cores=[{first}]",
    )
    nodes_run = _create(nodes)
    node1_config = nodes.model_copy(
        update={"learner": nodes.learner.model_copy(update={"cpu_cores": [second]})}
    )
    lines: dict[int, list[str]] = {0: [], 1: []}
    errors: dict[int, BaseException] = {}

    def node(rank: int) -> None:
        try:
            if rank == 0:
                place = publish_node0(nodes_run, "attempt-1", 2)
                _train(nodes, place, lines[0])
            else:
                place = await_node0(nodes_run, "attempt-1", 1, 2, timeout_s=120)
                assert place.address == "127.0.0.1"
                _train(node1_config, place, lines[1])
        except BaseException as exc:  # reported below, with the other node's output
            errors[rank] = exc

    threads = [threading.Thread(target=node, args=(r,), name=f"node{r}") for r in (1, 0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=540)
    assert not any(t.is_alive() for t in threads), "a node did not finish"
    assert not errors, (
        f"{errors!r}\nnode 0:\n"
        + "\n".join(lines[0][-30:])
        + "\nnode 1:\n"
        + "\n".join(lines[1][-30:])
    )

    reference, reference_metrics = _trained(single_run)
    weights, metrics = _trained(nodes_run)
    assert sorted(weights) == sorted(reference)
    different = [name for name in reference if not torch.equal(weights[name], reference[name])]
    assert different == []
    # One line per step: one job of two ranks (two one-rank jobs would each be a rank 0).
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for ours, theirs in zip(metrics, reference_metrics, strict=True):
        timeless = {k for k in theirs if k != "time" and not k.startswith("perf/")}
        assert "actor/pg_loss" in timeless
        assert {k: ours[k] for k in timeless} == {k: theirs[k] for k in timeless}


def test_a_node_whose_node0_never_publishes_fails_clearly(tmp_path):
    run = open_location(str(tmp_path / "run"))
    with pytest.raises(RendezvousTimeoutError) as raised:
        await_node0(run, "nope", 1, 2, timeout_s=1.5)
    assert "nope" in str(raised.value)
    assert "learner.rendezvous_timeout_s" in str(raised.value)

    publish_node0(run, "three", 3)  # node 0 reads a configuration of three nodes, this one two
    with pytest.raises(ValueError, match="expects 3 nodes, this node 2"):
        await_node0(run, "three", 1, 2, timeout_s=1.5)
