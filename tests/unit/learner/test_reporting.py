"""The learner's metrics sink: JSONL in the run (both layouts, resumes, cut lines), real wandb
offline with one run id per streamrl run across resumes, and training going on when wandb
fails."""

from __future__ import annotations

import json
import uuid

import pytest

from storage.fs import open_location
from streamrl.learner.config import LoggingConfig
from streamrl.learner.metrics_records import latest_metrics, read_metrics, read_wandb_link
from streamrl.learner.reporting import MetricsReporter


def _step(step: int, reward: float = 0.5) -> dict:
    return {
        "step": step,
        "policy_version": step,
        "rollout/reward_mean": reward,
        "rollout/acc": 0.25,
        "actor/pg_loss": 0.1,
        "stream/staleness_mean": 1.0,
        "perf/learner_tokens_per_s": 1234.5,
    }


@pytest.fixture(autouse=True)
def _hermetic_wandb(tmp_path, monkeypatch):
    """No API key, no netrc, wandb's own settings and caches under tmp_path."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))


def test_jsonl_holds_every_step_and_a_relogged_step_keeps_its_last_record(tmp_path, caplog):
    run = open_location(str(tmp_path / "run"))
    cfg = LoggingConfig(wandb_mode="disabled", log_every=2)
    with caplog.at_level("INFO", "streamrl.learner.reporting"):
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
    # the console line every log_every steps, and at the last step
    ours = [r.getMessage() for r in caplog.records if r.name == "streamrl.learner.reporting"]
    assert [m.split(":")[0] for m in ours] == ["step 2/3", "step 2/3", "step 3/3"]
    assert not (tmp_path / "run" / "wandb").exists()  # disabled: no wandb files
    assert read_wandb_link(run) is None


def test_a_line_cut_by_a_killed_learner_is_skipped_and_the_next_life_starts_a_new_line(tmp_path):
    run = open_location(str(tmp_path / "run"))
    cfg = LoggingConfig(wandb_mode="disabled")
    with MetricsReporter(run, cfg, config={}, total_steps=3) as reporter:
        reporter.log(_step(1))
    jsonl = tmp_path / "run" / "metrics" / "learner.jsonl"
    with jsonl.open("a") as f:
        f.write('{"time": 1.0, "step": 2, "rollout/rew')  # killed mid-write
    with MetricsReporter(run, cfg, config={}, total_steps=3, start_step=1) as reporter:
        reporter.log(_step(2))
        reporter.log(_step(3))
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]


def test_object_store_layout_is_one_object_per_record(seaweedfs):
    run = open_location(
        f"s3://{seaweedfs.bucket}/runs/{uuid.uuid4().hex[:12]}",
        storage_options=seaweedfs.storage_options,
    )
    cfg = LoggingConfig(wandb_mode="disabled")
    with MetricsReporter(run, cfg, config={}, total_steps=2) as reporter:
        reporter.log({**_step(0), "value_pretrain_step": 1, "critic/vf_loss": 0.3})
        reporter.log(_step(1))
        reporter.log(_step(2))
    with MetricsReporter(run, cfg, config={}, total_steps=2, start_step=1) as reporter:
        reporter.log(_step(2, reward=0.75))  # a resumed learner redoes step 2
    records = read_metrics(run)
    assert [(r["step"], r.get("value_pretrain_step")) for r in records] == [
        (0, 1),
        (1, None),
        (2, None),
    ]
    assert records[-1]["rollout/reward_mean"] == 0.75
    names = sorted(p.rsplit("/", 1)[-1] for p in run.fs.ls(run.join("metrics")))
    assert names == [
        "learner-00000000-pretrain-000001.json",
        "learner-00000001.json",
        "learner-00000002.json",
    ]
    assert latest_metrics(run) == records[-1]  # the newest object alone


def test_offline_wandb_keeps_one_run_id_across_resumes(tmp_path):
    run = open_location(str(tmp_path / "run"))
    cfg = LoggingConfig(wandb_mode="auto")  # no API key: offline
    with MetricsReporter(run, cfg, config={"a": 1}, total_steps=2) as first:
        first.log(_step(1))
        link = first.wandb_url
    record = json.loads((tmp_path / "run" / "metrics" / "wandb.json").read_text())
    assert link.startswith("offline: wandb sync ")
    assert link.endswith(record["id"])
    assert read_wandb_link(run) == link
    with MetricsReporter(run, cfg, config={"a": 1}, total_steps=2, start_step=1) as second:
        second.log(_step(2))
        assert second.wandb_url == link
    assert (
        json.loads((tmp_path / "run" / "metrics" / "wandb.json").read_text())["id"]
        == (record["id"])
    )
    # a local run keeps its wandb files beside it: one folder per life, one wandb run id
    offline = list((tmp_path / "run" / "wandb" / "wandb").glob(f"offline-run-*-{record['id']}"))
    assert len(offline) == 2
    assert all(list(folder.glob(f"run-{record['id']}.wandb")) for folder in offline)
    assert [r["step"] for r in read_metrics(run)] == [1, 2]


def test_a_failing_wandb_leaves_jsonl_logging_working(tmp_path, monkeypatch, caplog):
    # online without an API key: wandb refuses at once, without touching the network
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    run = open_location(str(tmp_path / "run"))
    with (
        caplog.at_level("WARNING", "streamrl.learner.reporting"),
        MetricsReporter(
            run, LoggingConfig(wandb_mode="online"), config={}, total_steps=2
        ) as reporter,
    ):
        reporter.log(_step(1))
        reporter.log(_step(2))
        assert reporter.wandb_url is None
    ours = [r.getMessage() for r in caplog.records if r.name == "streamrl.learner.reporting"]
    assert len(ours) == 1  # warned once, not once per step
    assert "wandb is off" in ours[0]
    assert [r["step"] for r in read_metrics(run)] == [1, 2]


def test_other_ranks_report_nothing(tmp_path):
    run = open_location(str(tmp_path / "run"))
    with MetricsReporter(
        run, LoggingConfig(wandb_mode="offline"), config={}, total_steps=1, enabled=False
    ) as reporter:
        reporter.log(_step(1))
        assert reporter.wandb_url is None
    assert not (tmp_path / "run" / "metrics").exists()
    assert not (tmp_path / "run" / "wandb").exists()


def test_latest_metrics_reads_only_the_tail_of_a_long_log(tmp_path):
    run = open_location(str(tmp_path / "run"))
    assert latest_metrics(run) is None
    with MetricsReporter(
        run, LoggingConfig(wandb_mode="disabled"), config={}, total_steps=400
    ) as r:
        for step in range(1, 401):
            r.log(_step(step, reward=step / 1000))
    latest = latest_metrics(run, tail_bytes=1000)  # far less than the file: a cut first line
    assert latest == read_metrics(run)[-1]
    assert latest["step"] == 400
