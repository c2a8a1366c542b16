"""Health warnings read from storage (`streamrl.runs.health`), shown by `streamrl status`: a
learner starved by dynamic sampling — the learner's own stream source records the groups in a
row without signal in its progress record while it waits, since no step ever ends — and the
health conditions the learner recorded in its metrics, newest firing of each, with a resumed
learner's discarded steps left out. Older progress records (without the counts) still read."""

from __future__ import annotations

import json

import pytest

from storage.fs import open_location
from storage.stream.learner_progress import (
    LEARNER_PROGRESS,
    LearnerProgress,
    read_learner_progress,
    write_learner_progress,
)
from storage.stream.writer import StreamTimeoutError, StreamWriter
from streamrl.learner.batching import STARVED_BATCHES, starvation_warning
from streamrl.learner.checkpointing import TrainingState
from streamrl.learner.config import LoggingConfig
from streamrl.learner.health import HealthEvent
from streamrl.learner.reporting import MetricsReporter
from streamrl.learner.stream_source import StreamSource
from streamrl.learner.topology import Topology
from streamrl.runs.health import HealthWatch, health_warnings, starvation
from streamrl.runs.status import read_status
from streamrl.runs.status_format import format_status, to_json
from tests.unit.runs.built_runs import BATCH_GROUPS, VOCAB, group, new_run

ALIKE = STARVED_BATCHES * BATCH_GROUPS + 2  # groups in a row without signal: starved


def test_a_learner_starved_by_dynamic_sampling_shows_in_status(tmp_path):
    run, config = new_run(tmp_path / "run", "learner.stream_timeout_s=2")
    StreamWriter(run, "gen0").write([group(i, 0, [1.0] * 4) for i in range(ALIKE)])
    with Topology.from_env("cpu") as topology:
        source = StreamSource(
            config, run, topology, TrainingState(), vocab_size=VOCAB, lease=None,
            while_waiting=lambda: None,
        )  # fmt: skip
        with pytest.raises(StreamTimeoutError):  # no batch fills: the step never ends
            source.next_batch()
        source.close()
    progress = read_learner_progress(run)
    assert (progress.step, progress.waiting) == (0, True)
    assert (progress.no_signal_correct, progress.no_signal_wrong) == (ALIKE, 0)
    expected = f"health: starved at step 1: {starvation_warning(ALIKE, 0)}"
    assert health_warnings(run) == [expected]
    assert expected.startswith(
        f"health: starved at step 1: no signal in the last {ALIKE} groups: {ALIKE} had every "
        "response correct, 0 every response wrong; dynamic sampling drops such groups"
    )
    status = read_status(run)
    assert status.health == (expected,)
    shown = expected.removeprefix("health: ")
    assert f"health     {shown}" in format_status(status).splitlines()
    assert json.loads(to_json(status))["health"] == [expected]


def test_starvation_needs_starved_batches_worth_of_groups_without_signal():
    def progress(correct: int, wrong: int) -> LearnerProgress:
        return LearnerProgress(
            step=3, policy_version=3, no_signal_correct=correct, no_signal_wrong=wrong
        )

    threshold = STARVED_BATCHES * BATCH_GROUPS
    assert starvation(None, BATCH_GROUPS) is None
    assert starvation(progress(threshold - 2, 1), BATCH_GROUPS) is None
    assert starvation(progress(1, threshold - 1), BATCH_GROUPS) == (
        f"health: starved at step 4: {starvation_warning(1, threshold - 1)}"
    )
    assert "The data is too hard for the model now" in starvation_warning(1, threshold - 1)


def _event(condition: str, step: int) -> dict:
    return HealthEvent(condition, step, 1.0, 0.5, f"health: {condition} at step {step}").as_record()


def test_health_conditions_recorded_in_the_metrics_show_newest_first_fired(tmp_path):
    run, _ = new_run(tmp_path / "run")
    watch = HealthWatch(run)
    assert watch.read() == []
    logging = LoggingConfig(wandb_mode="disabled")
    with MetricsReporter(run, logging, config={}, total_steps=9) as reporter:
        reporter.log({"step": 1, "health": [_event("entropy-collapse", 1)]})
        reporter.log({"step": 2, "health": [_event("waste-high", 2)]})
        reporter.log({"step": 3, "health": [_event("entropy-collapse", 3)]})
        assert watch.read() == [
            "health: waste-high at step 2",
            "health: entropy-collapse at step 3",
        ]
        reporter.log({"step": 4, "health": [_event("kl-high", 4)]})
        # A learner resumed from its checkpoint of step 2 logs step 3 again, without an event:
        # what steps 3 and 4 of the discarded training fired is gone.
        reporter.log({"step": 3})
    assert watch.read() == ["health: waste-high at step 2"]
    assert health_warnings(run) == ["health: waste-high at step 2"]


def test_progress_records_from_before_the_counts_read_as_zero_and_bad_counts_are_refused(
    tmp_path,
):
    run = open_location(str(tmp_path / "run"))
    older = {"step": 2, "policy_version": 2, "cursor": {"seq": 3, "offset": 0}, "waiting": True}
    run.fs.makedirs(run.join("control"), exist_ok=True)
    run.fs.pipe_file(run.join(*LEARNER_PROGRESS), json.dumps(older).encode())
    progress = read_learner_progress(run)
    assert (progress.no_signal_correct, progress.no_signal_wrong) == (0, 0)
    with pytest.raises(ValueError, match="counts are ≥ 0"):
        LearnerProgress.from_json(json.dumps({**older, "no_signal_wrong": -1}).encode())
    with pytest.raises(ValueError, match="unreadable"):
        LearnerProgress.from_json(json.dumps({**older, "no_signal_wrong": "many"}).encode())


def test_the_flow_logs_each_health_warning_once_as_it_appears(tmp_path):
    """The parent flow's log (`flows.run.HealthLog`): a container's learner log is not where an
    operator looks. Each warning once, not at every refresh."""
    import logging

    from flows.run import HealthLog

    run, _ = new_run(tmp_path / "run")
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("test-health-log")
    logger.addHandler(Collect())
    health = HealthLog(run, logger)
    health.refresh()
    assert records == []  # a healthy run: nothing
    progress = LearnerProgress(
        step=0, policy_version=0, waiting=True, no_signal_correct=0, no_signal_wrong=ALIKE
    )
    write_learner_progress(run, progress)
    health.refresh()
    health.refresh()
    assert records == health_warnings(run)
    assert len(records) == 1
    assert "dynamic sampling drops such groups" in records[0]
    more = LearnerProgress(  # the learner, still starved, counts on: still one line
        step=0, policy_version=0, waiting=True, no_signal_correct=0, no_signal_wrong=2 * ALIKE
    )
    write_learner_progress(run, more)
    health.refresh()
    assert len(records) == 1
