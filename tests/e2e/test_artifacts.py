"""The flow's artifacts against a real (temporary) Prefect server: `RunArtifacts` publishes,
next to the learner's metrics, the quarantined-segments total and the generators' failed
reward calls tallied from the stream's commit records; keys come from the run's name; the
curves artifact is one PNG that replaces its previous version; the progress artifact is
updated only when it moved; health conditions the learner recorded become Prefect events; a
health warning of a run the flow supervises reaches the flow's log once."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import sys
import time

import numpy as np
import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
from prefect.context import get_run_context
from prefect.events.filters import EventFilter, EventNameFilter, EventRelatedFilter
from prefect.testing.utilities import prefect_test_harness

from flows.artifacts import RunArtifacts
from flows.run import REFRESH_S
from storage.control.manifest import create_run
from storage.fs import open_location
from storage.stream.writer import StreamWriter
from streamrl.config.loading import load_config
from tests.stream_data import random_group
from tests.unit.supervision.test_supervisor import _completing, _until_stop_marker

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
    return [a.data for a in artifacts if a.type == "markdown" and a.key.endswith("-metrics")]


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


def _record(step: int, **extra: object) -> str:
    metrics = {"rollout/reward_mean": -1 + step / 4, "rollout/acc": step / 8, "actor/entropy": 1.0}
    return json.dumps({"time": time.time(), "step": step, **metrics, **extra}) + "\n"


def _waste(step: int) -> dict:
    return {
        "health": [
            {
                "condition": "waste-high",
                "step": step,
                "value": 0.8,
                "threshold": 0.5,
                "message": f"waste fraction 0.80 above 0.5 at step {step}",
            }
        ]
    }


@flow
def follow(run_uri: str) -> str:
    """The flow's refreshes over a run whose learner logs while the flow watches: nothing yet;
    steps 1-3 (step 2 reports a health condition); nothing new; step 4 (another), final."""
    config = load_config(["dapo", "tiny-cpu"], overrides=[f"storage.run_uri={run_uri}"])
    artifacts = RunArtifacts(config, open_location(run_uri), curves_every_s=0.0)
    jsonl = open_location(run_uri).join("metrics", "learner.jsonl")
    artifacts.refresh()
    with open(jsonl, "a") as f:
        f.write(_record(1) + _record(2, **_waste(2)) + _record(3))
    artifacts.refresh()
    artifacts.refresh()  # nothing new: nothing published
    with open(jsonl, "a") as f:
        f.write(_record(4, **_waste(4)))
    artifacts.refresh(final=True)
    return str(get_run_context().flow_run.id)


async def _flow_run_artifacts(flow_run_id: str) -> list:
    async with get_client() as client:
        return await client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )


async def _events(prefix: str, flow_run_id: str, count: int, within_s: float = 60) -> list:
    """The events named `prefix*` related to the flow run, once `count` arrived (the server
    stores events asynchronously), or what arrived within `within_s`."""
    wanted = EventFilter(
        event=EventNameFilter(prefix=[prefix]),
        related=EventRelatedFilter(id=[f"prefect.flow-run.{flow_run_id}"]),
    )
    async with get_client() as client:
        for _ in range(int(within_s / 0.5)):
            page = await client.read_events(filter=wanted, limit=50)
            if len(page.events) >= count:
                break
            await asyncio.sleep(0.5)
    return sorted(page.events, key=lambda e: e.occurred)


def test_artifacts_are_keyed_by_run_name_curves_replace_themselves_health_becomes_events(
    prefect_server, tmp_path
):
    run_dir = tmp_path / "runs" / "Warm-Start 7"
    config = load_config(["dapo", "tiny-cpu"], overrides=[f"storage.run_uri={run_dir}"])
    create_run(open_location(str(run_dir)), config.model_dump(mode="json"))
    (run_dir / "metrics").mkdir()
    flow_run_id = follow(str(run_dir))

    artifacts = asyncio.run(_flow_run_artifacts(flow_run_id))
    keys = {a.key for a in artifacts}
    assert keys == {
        "streamrl-warm-start-7-progress",
        "streamrl-warm-start-7-metrics",
        "streamrl-warm-start-7-curves",
    }  # from the run's name, not the machine's path
    (curves,) = [a for a in artifacts if a.key.endswith("-curves")]  # older versions deleted
    image = curves.data.split("data:image/png;base64,")[1].split(")")[0]
    assert base64.b64decode(image).startswith(b"\x89PNG")
    assert "- step 2: waste-high" in curves.data
    assert "- step 4: waste-high" in curves.data
    assert "step 4 / " in curves.data

    health = asyncio.run(_events("streamrl.health.", flow_run_id, count=2))
    assert [(e.event, e.payload["step"]) for e in health] == [
        ("streamrl.health.waste-high", 2),
        ("streamrl.health.waste-high", 4),
    ]
    assert health[0].resource.id == "streamrl.run.warm-start-7"
    assert health[0].payload["threshold"] == 0.5
    # progress moved twice (3/N, then 4/N): two updates, not one per refresh
    updates = asyncio.run(_events("prefect.artifact.updated", flow_run_id, count=2))
    assert len(updates) == 2

    # Another flow run over the same run (a resumed one): the old conditions are not re-sent.
    again = publish(str(run_dir))
    assert asyncio.run(_events("streamrl.health.", again, count=1, within_s=5)) == []


def test_the_table_follows_value_pretraining_before_the_first_step(prefect_server, tmp_path):
    run_dir = tmp_path / "vapo"
    config = load_config(["dapo", "tiny-cpu"], overrides=[f"storage.run_uri={run_dir}"])
    create_run(open_location(str(run_dir)), config.model_dump(mode="json"))
    (run_dir / "metrics").mkdir()
    pretraining = [
        {"time": time.time(), "step": 0, "value_pretrain_step": k, "critic/vf_loss": loss}
        for k, loss in ((1, 0.9), (2, 0.5))
    ]
    (run_dir / "metrics" / "learner.jsonl").write_text(
        "".join(json.dumps(line) + "\n" for line in pretraining)
    )
    flow_run_id = publish(str(run_dir))
    (table,) = asyncio.run(_tables(flow_run_id))
    assert "| value loss | 0.5000 |" in table  # the newest pre-training record
    artifacts = asyncio.run(_flow_run_artifacts(flow_run_id))
    assert not [a for a in artifacts if a.key.endswith("-curves")]  # no learner step yet


HEALTH = "health: waste-high at step 1: waste fraction 0.80 above 0.5"


def _learner_with_a_health_warning(run_dir) -> list[str]:
    """A stand-in learner: it records a health condition with its step, logs it as the learner
    does, stays alive over several of the flow's refreshes, then completes (the stop marker)."""
    record = {"time": 0.0, "step": 1, "policy_version": 1,
              "health": [{"condition": "waste-high", "step": 1, "message": HEALTH}]}  # fmt: skip
    code = f"""
import json, os, time
os.makedirs({str(run_dir / "metrics")!r}, exist_ok=True)
with open({str(run_dir / "metrics" / "learner.jsonl")!r}, "a") as f:
    f.write(json.dumps({record!r}) + "\\n")
print("2026-12-08 00:00:00,000 WARNING streamrl.learner.loop: " + {HEALTH!r}, flush=True)
time.sleep(4 * {REFRESH_S!r})
{_completing(run_dir)}
"""
    return [sys.executable, "-c", code]


def test_a_supervised_runs_health_warning_reaches_the_flow_log_once(
    prefect_server, tmp_path, monkeypatch
):
    """The learner's warning comes with its lines; the flow does not log it a second time from
    the run's health records (those are for runs on work pools, whose lines stay remote)."""
    from flows.run import supervise
    from streamrl.supervision import supervisor as core

    run_dir = tmp_path / "run"
    monkeypatch.setattr(
        core,
        "learner_command",
        lambda config, node=None, **kw: _learner_with_a_health_warning(run_dir),
    )
    monkeypatch.setattr(core, "generator_command",
                        lambda config, index, **kw: [sys.executable, "-c",
                                                     _until_stop_marker(run_dir)])  # fmt: skip
    shown: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            shown.append(record.getMessage())

    @flow
    def supervised() -> None:
        config = load_config(["dapo", "tiny-cpu"], overrides=[f"storage.run_uri={run_dir}"])
        supervise(config, generators=1, evaluate=False)

    handler = Collect()
    logging.getLogger("prefect").addHandler(handler)
    try:
        supervised()
    finally:
        logging.getLogger("prefect").removeHandler(handler)
    assert sum(HEALTH in line for line in shown) == 1, shown
