"""A run placed on work pools, end to end on the local stack (`scripts/stack.sh up`: a Prefect
server and one process worker for each of the pools `local`, `learner` and `generators`): a
`streamrl/dapo` deployment run with `placement.mode=pools` fans out into child flow runs of the
`learner` and `generator` deployments; killing a generator flow run's process gets it replaced
and the run completes; `streamrl scale` starts and stops generator flow runs; cancelling the
parent cancels its children and leaves no process of the run behind; a learner of two nodes
(two flow runs meeting through the run's storage) and the evaluator complete as children."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from uuid import UUID

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterParentTaskRunId,
    TaskRunFilter,
    TaskRunFilterFlowRunId,
)
from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings
from prefect.states import Cancelling

from storage.fs import open_location
from storage.weights.versions import WeightStore

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

TINY = [
    "placement.mode=pools",
    "generator.max_tokens=16",
    "generator.segment_groups=2",
    "learner.batch_groups=2",
    "learner.mini_batch_groups=2",
    "learner.checkpoint_every=2",
    "algorithm.dynamic_sampling=false",  # the random tiny model's groups are mostly all-wrong
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The local stack in a temporary stack dir and Prefect home; yields the client's env."""
    home = tmp_path_factory.mktemp("stack")
    port = free_port()
    env = {
        **os.environ,
        "STREAMRL_STACK_DIR": str(home / "stack"),
        "STREAMRL_PREFECT_PORT": str(port),
        "STREAMRL_PREFECT_PROFILE": "",
        "PREFECT_HOME": str(home / "prefect-home"),
    }
    inherited_names = ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "PREFECT_PROFILE")
    for inherited in (*inherited_names, "STREAMRL_ROOT", "S3"):
        env.pop(inherited, None)

    api = f"http://127.0.0.1:{port}/api"
    try:
        stack_sh("up", env)
        auth = (home / "stack" / "auth").read_text().strip()  # the server's own credential
        with temporary_settings({PREFECT_API_URL: api, PREFECT_API_AUTH_STRING: auth}):
            yield {**env, "PREFECT_API_URL": api, "PREFECT_API_AUTH_STRING": auth}
    finally:
        stack_sh("down", env)


def stack_sh(action: str, env: dict[str, str]) -> str:
    """`scripts/stack.sh <action>` with `env`; its output."""
    done = subprocess.run(
        ["bash", "scripts/stack.sh", action], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, f"stack.sh {action}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _start(run_dir: Path, steps: int, generators: int, extra: list[str] | None = None) -> UUID:
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("streamrl/dapo")
        flow_run = client.create_flow_run_from_deployment(
            deployment.id,
            parameters={
                "size": "tiny-cpu",
                "run_uri": str(run_dir),
                "generators": generators,
                "overrides": [*TINY, f"learner.total_steps={steps}", *(extra or [])],
            },
        )
    return flow_run.id


def _children(parent: UUID) -> list:
    """The parent's child flow runs (started with run_deployment: linked through a task run of
    the parent), oldest first."""
    with get_client(sync_client=True) as client:
        tasks = client.read_task_runs(
            task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[parent]))
        )
        if not tasks:
            return []
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                parent_task_run_id=FlowRunFilterParentTaskRunId(any_=[t.id for t in tasks])
            )
        )
    return sorted(runs, key=lambda r: r.created)


def _state(flow_run_id: UUID):
    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).state


def _wait_for(what: str, predicate, timeout_s: float = 600.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if found := predicate():
            return found
        time.sleep(2)
    raise AssertionError(f"timed out waiting for {what}")


def _flow_run_process(flow_run_id: UUID) -> int | None:
    """The PID of the process a worker started for `flow_run_id` (not its components')."""
    marker = f"PREFECT__FLOW_RUN_ID={flow_run_id}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if marker in environ.split(b"\0") and b"streamrl" not in command.split(b"\0")[1:3]:
            return int(entry.name)
    return None


def _processes_of(run_dir: Path) -> list[int]:
    """PIDs of processes whose command line names `run_dir` (the run's components)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(run_dir).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _named(children: list, suffix: str) -> list:
    return [c for c in children if c.name.endswith(f"-{suffix}")]


def test_a_run_on_pools_fans_out_replaces_a_killed_generator_and_completes(stack, tmp_path):
    run_dir = tmp_path / "pools"
    parent = _start(run_dir, steps=40, generators=2)

    def gen0_running():
        runs = _named(_children(parent), "gen0")
        return runs and runs[0].state.is_running() and (run_dir / "logs" / "gen0.log").exists()

    _wait_for("gen0's flow run to run", gen0_running)
    first_gen0 = _named(_children(parent), "gen0")[0]
    pid = _wait_for("gen0's flow run process", lambda: _flow_run_process(first_gen0.id), 60)
    os.kill(pid, signal.SIGKILL)  # its node is gone

    _wait_for("the parent to end", lambda: _state(parent).is_final(), 900)
    assert _state(parent).is_completed(), _state(parent)
    children = _children(parent)
    assert {c.flow_id for c in children}  # every child is linked to the parent
    names = sorted(c.name.rsplit("-", 1)[-1] for c in children)
    assert names.count("gen0") == 2, names  # the lost one and its replacement
    assert names.count("gen1") == 1, names
    assert names.count("learner") == 1, names
    assert _state(first_gen0.id).is_crashed()
    assert all(_state(c.id).is_completed() for c in children if c.id != first_gen0.id)
    assert WeightStore(open_location(str(run_dir))).versions()[-1] == 40
    assert not _processes_of(run_dir)


def test_scaling_and_cancelling_the_parent_cancels_its_children(stack, tmp_path):
    run_dir = tmp_path / "scaled"
    parent = _start(run_dir, steps=10_000, generators=1)
    _wait_for("gen0 to run", lambda: any(
        c.state.is_running() for c in _named(_children(parent), "gen0")))  # fmt: skip

    def scale(count: int) -> None:
        done = subprocess.run(
            [sys.executable, "-m", "streamrl", "scale", str(run_dir), "--generators", str(count)],
            capture_output=True, text=True, env=stack, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert f"{count} generator(s) asked for" in done.stdout

    scale(2)
    _wait_for("gen1 to run", lambda: any(
        c.state.is_running() for c in _named(_children(parent), "gen1")))  # fmt: skip
    scale(1)  # the newest, gen1, flushes its open segment and its flow run completes
    gen1 = _named(_children(parent), "gen1")[0]
    _wait_for("gen1 to complete", lambda: _state(gen1.id).is_final(), 300)
    assert _state(gen1.id).is_completed()
    assert (run_dir / "control" / "stop" / "gen1.json").exists()

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(parent, Cancelling(message="test"), force=True)
    _wait_for("the parent to be cancelled", lambda: _state(parent).is_cancelled(), 300)
    children = _children(parent)
    _wait_for("every child to end", lambda: all(_state(c.id).is_final() for c in children), 300)
    still = {c.name: _state(c.id).type.value for c in children}
    assert all(_state(c.id).is_cancelled() for c in children if c.id != gen1.id), still
    _wait_for("no process of the run", lambda: not _processes_of(run_dir), 120)


def test_a_learner_of_two_nodes_and_the_evaluator_run_as_flow_runs_of_their_own(stack, tmp_path):
    run_dir = tmp_path / "nodes"
    evaluation = ["eval.every_versions=2", "eval.max_prompts=4", "eval.k=2"]
    parent = _start(run_dir, steps=4, generators=1, extra=["learner.nnodes=2", *evaluation])
    _wait_for("the parent to end", lambda: _state(parent).is_final(), 900)
    assert _state(parent).is_completed(), _state(parent)
    children = {c.name.rsplit("-", 1)[-1]: c for c in _children(parent)}
    assert sorted(children) == ["eval", "gen0", "node0", "node1"]  # <run>-learner-node<k>
    assert all(_state(c.id).is_completed() for c in children.values())
    attempts = {children[n].parameters["attempt"] for n in ("node0", "node1")}
    assert len(attempts) == 1  # both nodes of one attempt, which node 0 published
    assert (run_dir / "control" / "rendezvous" / f"{attempts.pop()}.json").exists()
    assert WeightStore(open_location(str(run_dir))).versions()[-1] == 4
    metrics = (run_dir / "metrics" / "learner.jsonl").read_text().splitlines()
    assert len(metrics) == 4  # one learner of two nodes, not two learners
    evaluated = (run_dir / "metrics" / "eval.jsonl").read_text().splitlines()
    assert [json.loads(line)["version"] for line in evaluated] == [2, 4]
