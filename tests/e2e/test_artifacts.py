"""The flow's metrics artifact against a real (temporary) Prefect server: `RunArtifacts`
publishes, next to the learner's metrics, the quarantined-segments total and the generators'
failed reward calls tallied from the stream's commit records."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
from prefect.context import get_run_context
from prefect.testing.utilities import prefect_test_harness

from flows.artifacts import RunArtifacts
from storage.fs import open_location
from storage.manifest import create_run
from storage.stream import StreamWriter
from streamrl.config import load_config
from tests.stream_data import random_group

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def prefect_server():
    with prefect_test_harness(server_startup_timeout=120):
        yield


@flow
def publish(run_uri: str) -> str:
    """One refresh of the run's artifacts, as the `streamrl` flow does; its flow run id."""
    config = load_config(["dapo", "tiny-cpu"], overrides=[f"storage.run_uri={run_uri}"])
    RunArtifacts(config, open_location(run_uri)).refresh(final=True)
    return str(get_run_context().flow_run.id)


async def _tables(flow_run_id: str) -> list[str]:
    async with get_client() as client:
        artifacts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    return [a.data for a in artifacts if a.type == "markdown"]


def test_metrics_artifact_shows_reward_failures_and_quarantined_segments(prefect_server, tmp_path):
    run_dir = tmp_path / "run"
    run = open_location(str(run_dir))
    config = load_config(["dapo", "tiny-cpu"], overrides=[f"storage.run_uri={run_dir}"])
    create_run(run, config.model_dump(mode="json"))
    rng = np.random.default_rng(0)
    groups = [random_group(rng, prompt_id=f"p{i}", vocab=600) for i in range(4)]
    gen0, gen1 = StreamWriter(run, "gen0"), StreamWriter(run, "gen1")
    gen0.count_reward_failures(errors=5, timeouts=2, dropped_groups=3)
    gen0.write(groups[:2])
    gen1.write(groups[2:])
    line = {"time": time.time(), "step": 1, "policy_version": 1, "stream/quarantined_total": 2}
    (run_dir / "metrics").mkdir()
    (run_dir / "metrics" / "learner.jsonl").write_text(json.dumps(line) + "\n")

    (table,) = asyncio.run(_tables(publish(str(run_dir))))
    assert "| quarantined segments (total) | 2 |" in table
    assert "| reward errors / timeouts / groups dropped (total) | 5 / 2 / 3 |" in table
    assert "| reward errors / timeouts / groups dropped (gen0) | 5 / 2 / 3 |" in table
    assert "(gen1)" not in table  # a generator without failures gets no row
