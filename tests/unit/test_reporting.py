"""The learner's metrics sink: JSONL in the run (both layouts), wandb offline with one run id
per streamrl run across resumes, and training going on when wandb fails."""

from __future__ import annotations

import json

import pytest

from storage.fs import open_location
from streamrl.config import LoggingConfig
from streamrl.learner.reporting import MetricsReporter, read_metrics


def _step(step: int, reward: float = 0.5) -> dict:
    return {
        "step": step,
        "policy_version": step,
        "rollout/reward_mean": reward,
        "rollout/acc": 0.25,
        "actor/pg_loss": 0.1,
        "stream/staleness_mean": 1.0,
    }


@pytest.fixture(autouse=True)
def _offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)


def test_jsonl_holds_every_step_and_a_relogged_step_keeps_its_last_record(tmp_path):
    run = open_location(str(tmp_path / "run"))
    cfg = LoggingConfig(wandb_mode="disabled", log_every=2)
    with MetricsReporter(run, cfg, config={}, total_steps=3) as reporter:
        reporter.log(_step(1))
        reporter.log(_step(2))
    with MetricsReporter(run, cfg, config={}, total_steps=3, start_step=1) as reporter:
        reporter.log(_step(2, reward=0.75))  # a resumed learner redoes step 2
        reporter.log(_step(3))
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[1]["rollout/reward_mean"] == 0.75
    assert len((tmp_path / "run" / "metrics" / "learner.jsonl").read_text().splitlines()) == 4
    assert not (tmp_path / "run" / "wandb").exists()  # disabled: no wandb files


def test_object_store_layout_is_one_object_per_record(run_location, backend):
    if backend == "local":
        pytest.skip("the object layout is for object stores")
    cfg = LoggingConfig(wandb_mode="disabled")
    with MetricsReporter(run_location, cfg, config={}, total_steps=2) as reporter:
        reporter.log({**_step(0), "value_pretrain_step": 1, "critic/vf_loss": 0.3})
        reporter.log(_step(1))
        reporter.log(_step(2))
    records = read_metrics(run_location)
    assert [(r["step"], r.get("value_pretrain_step")) for r in records] == [
        (0, 1),
        (1, None),
        (2, None),
    ]


def test_offline_wandb_keeps_one_run_id_across_resumes(tmp_path):
    run = open_location(str(tmp_path / "run"))
    cfg = LoggingConfig(wandb_mode="auto")  # no API key: offline
    with MetricsReporter(run, cfg, config={"a": 1}, total_steps=2) as first:
        first.log(_step(1))
        assert first.wandb_url is not None
    record = json.loads((tmp_path / "run" / "metrics" / "wandb.json").read_text())
    with MetricsReporter(run, cfg, config={"a": 1}, total_steps=2, start_step=1) as second:
        second.log(_step(2))
    assert (
        json.loads((tmp_path / "run" / "metrics" / "wandb.json").read_text())["id"] == record["id"]
    )
    offline = list((tmp_path / "run" / "wandb" / "wandb").glob(f"offline-run-*-{record['id']}"))
    assert len(offline) == 2  # two lives, one wandb run id
    assert [r["step"] for r in read_metrics(run)] == [1, 2]


def test_a_failing_wandb_leaves_jsonl_logging_working(tmp_path, monkeypatch, caplog):
    import wandb

    def refuse(**_):
        raise wandb.errors.CommError("network unreachable")

    monkeypatch.setattr(wandb, "init", refuse)  # fault injection: no network here to fail on
    run = open_location(str(tmp_path / "run"))
    with (
        caplog.at_level("WARNING"),
        MetricsReporter(
            run, LoggingConfig(wandb_mode="online"), config={}, total_steps=1
        ) as reporter,
    ):
        reporter.log(_step(1))
    assert "wandb is off" in caplog.text
    assert [r["step"] for r in read_metrics(run)] == [1]


def test_other_ranks_report_nothing(tmp_path):
    run = open_location(str(tmp_path / "run"))
    with MetricsReporter(
        run, LoggingConfig(wandb_mode="offline"), config={}, total_steps=1, enabled=False
    ) as reporter:
        reporter.log(_step(1))
    assert not (tmp_path / "run" / "metrics").exists()
    assert not (tmp_path / "run" / "wandb").exists()
