"""The Prefect flows end to end on the tiny model, against a real (temporary) Prefect server:
a deployment of the `streamrl` flow run by a process runner completes with its artifacts;
a killed learner resumes from its checkpoint; a killed generator is restarted; a generator that
always fails makes the flow run end Failed with the reason in its logs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
from prefect.deployments import run_deployment
from prefect.runner import Runner
from prefect.testing.utilities import prefect_test_harness

from storage.checkpoints.dcp import CheckpointStore
from storage.fs import open_location
from storage.weights.versions import WeightStore
from streamrl.runs.summary import run_summary

pytestmark = pytest.mark.timeout(900)

TINY = [
    "generator.max_tokens=16",
    "generator.segment_groups=2",
    "learner.batch_groups=2",
    "learner.mini_batch_groups=2",
    "learner.checkpoint_every=2",
    "algorithm.dynamic_sampling=false",  # the random tiny model's groups are mostly all-wrong
]


@pytest.fixture(scope="module")
def prefect_server():
    with prefect_test_harness(server_startup_timeout=120):
        yield


def _flow_kwargs(run_dir: Path, steps: int, *extra: str) -> dict:
    return {
        "preset": "dapo",
        "size": "tiny-cpu",
        "overrides": [*TINY, f"learner.total_steps={steps}", *extra],
        "run_uri": str(run_dir),
        "generators": 1,
    }


async def _flow_run_artifacts(flow_run_id) -> list:
    async with get_client() as client:
        return await client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )


def _logs(flow_run_id) -> str:
    """The flow run's log messages as the API has them, once this process has sent it every
    one (Prefect sends log records in batches, in the background: the last ones may not be
    there when the flow returns)."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()  # blocks until every record queued in this process is sent

    async def read():
        async with get_client() as client:
            return await client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
            )

    return "\n".join(log.message for log in asyncio.run(read()))


def test_deployment_of_the_streamrl_flow_completes_with_artifacts(prefect_server, tmp_path):
    from flows.run import streamrl_run

    run_dir = tmp_path / "run"

    runner = Runner(name="e2e", limit=1)
    evaluation = ["eval.every_versions=2", "eval.max_prompts=4", "eval.k=2"]
    parameters = _flow_kwargs(run_dir, 4, *evaluation)
    runner.add_flow(streamrl_run, name="dapo", parameters=parameters)
    created = run_deployment("streamrl/dapo", timeout=0)
    asyncio.run(runner.start(run_once=True))

    async def read():
        async with get_client() as client:
            return await client.read_flow_run(created.id)

    flow_run = asyncio.run(read())
    assert flow_run.state.is_completed(), flow_run.state

    run = open_location(str(run_dir))
    assert list((run_dir / "stream" / "log").glob("*.json"))
    assert WeightStore(run).versions()[-1] == 4
    assert CheckpointStore(run).committed_steps()[-1] == 4

    artifacts = asyncio.run(_flow_run_artifacts(flow_run.id))
    progress = [a for a in artifacts if a.type == "progress"]
    assert progress[0].data == pytest.approx(100.0)  # updated in place
    tables = sorted(
        (a for a in artifacts if a.key == "streamrl-run-metrics"), key=lambda a: a.created
    )
    assert tables  # re-published as steps arrive (how many depends on timing) and at the end
    table = tables[-1].data
    (curves,) = [a for a in artifacts if a.key == "streamrl-run-curves"]  # the last version only
    assert "step 4 / 4" in curves.data
    assert "data:image/png;base64," in curves.data
    last = json.loads((run_dir / "metrics" / "learner.jsonl").read_text().splitlines()[-1])
    assert f"{last['rollout/reward_mean']:.3f}" in table
    assert "step 4 / 4" in table
    # The evaluator task scored versions 2 and 4 (every 2nd, and the last) in its own process.
    evaluated = [
        json.loads(x) for x in (run_dir / "metrics" / "eval.jsonl").read_text().splitlines()
    ]
    assert [r["version"] for r in evaluated] == [2, 4]
    assert "val/acc_greedy (v4)" in table


def _wait_for(predicate, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def _pids(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_killed_components_are_restarted_and_the_run_resumes(prefect_server, tmp_path):
    """SIGKILL a generator: its task retries. SIGKILL the learner after its first checkpoint:
    its retry resumes there. The run completes with every step done once."""
    from flows.run import streamrl_run

    run_dir = tmp_path / "run"
    run = open_location(str(run_dir))
    result: dict = {}
    thread = threading.Thread(
        target=lambda: result.update(out=streamrl_run(**_flow_kwargs(run_dir, steps=6))),
        daemon=True,
    )
    thread.start()
    _wait_for(lambda: bool(_pids(f"streamrl generator --run {run_dir}")))
    _wait_for(lambda: (run_dir / "stream" / "log").exists())
    for pid in _pids(f"streamrl generator --run {run_dir}"):
        os.kill(pid, signal.SIGKILL)
    _wait_for(lambda: bool(CheckpointStore(run).committed_steps()))
    for pid in _pids(f"streamrl learner --run {run_dir}"):
        os.kill(pid, signal.SIGKILL)
    thread.join(timeout=800)
    assert not thread.is_alive()
    summary = result["out"]
    assert summary["steps"] == 6
    assert summary["restarts"].get("gen0", 0) >= 1
    assert summary["restarts"].get("learner", 0) == 1
    steps = [
        json.loads(x)["step"]
        for x in (run_dir / "metrics" / "learner.jsonl").read_text().splitlines()
    ]
    assert sorted(set(steps)) == list(range(1, 7))  # a re-logged step after the kill is fine
    assert run_summary(run)["steps"] == 6


def test_a_generator_that_always_fails_fails_the_flow_run_with_its_reason(prefect_server, tmp_path):
    from flows.run import streamrl_run

    run_dir = tmp_path / "run"
    # The module is there, the function is not: the same every time, so not retried.
    kwargs = _flow_kwargs(run_dir, 4, "generator.reward.fn=tests.reward_fns:no_such_function")
    kwargs["generator_retries"] = 1

    state = streamrl_run(**kwargs, return_state=True)
    assert state.is_failed()
    logs = _logs(state.state_details.flow_run_id)
    assert "gen0 cannot run" in str(state.message) + logs
    assert "not restarted" in str(state.message) + logs
    assert "no_such_function" in logs
