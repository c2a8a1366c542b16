"""Flow control's admission rule, against capacities computed by hand, and the gate's backlog
read from a real stream and learner record (local folder and SeaweedFS)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from storage.fs import Location
from storage.stream.learner_progress import LearnerProgress, write_learner_progress
from storage.stream.records import Cursor
from storage.stream.writer import StreamWriter
from streamrl.config.loading import load_config
from streamrl.generator.flow_control import (
    FlowGate,
    accept_rate,
    admission_capacity,
    groups_per_step,
)
from streamrl.learner.config import LearnerConfig
from tests.stream_data import random_group


@pytest.mark.parametrize(
    ("staleness", "publish_every", "batch", "learner_v", "generator_v", "rate", "expected"),
    [
        (4, 1, 16, 0, 0, 1.0, 80.0),  # 5 versions × 1 step × 16 groups
        (1, 2, 4, 3, 2, 0.5, 16.0),  # lag 1: 1 version × 2 steps × 4 groups / 0.5
        (2, 1, 8, 5, 5, 0.25, 96.0),  # 3 versions × 8 groups × 4 consumed per accepted
        (0, 1, 2, 1, 0, 1.0, 0.0),  # on-policy and one version behind: nothing usable
        (1, 1, 2, 4, 0, 1.0, -4.0),  # far behind: (1 + 1 − 4) × 2, admits nothing
        (0, 1, 2, 0, 3, 1.0, 2.0),  # the learner's record lags our weights: lag taken as 0
    ],
)
def test_admission_capacity_by_hand(
    staleness, publish_every, batch, learner_v, generator_v, rate, expected
):
    capacity = admission_capacity(
        max_staleness=staleness,
        publish_every=publish_every,
        batch_groups=batch,
        learner_version=learner_v,
        generator_version=generator_v,
        accept_rate=rate,
    )
    assert capacity == pytest.approx(expected)


@pytest.mark.parametrize(
    ("staleness", "publish_every", "steps_since", "pending", "rate", "expected"),
    [
        (0, 1, 0, 4, 0.8, 0.0),  # synchronous, the learner trains on its batch: nothing usable
        (0, 1, 0, 3, 0.8, 1.25),  # one of 4 groups still to accept, 4 in 5 accepted
        (0, 1, 0, 0, 0.8, 5.0),  # a step starts: B / a
        (1, 2, 1, 1, 0.5, 22.0),  # (2 versions × 2 steps × 4 − 1 step × 4 − 1) / 0.5
        (4, 1, 0, 4, 1.0, 16.0),  # asynchronous: 5 × 4 − 4
    ],
)
def test_admission_capacity_leaves_out_what_the_learner_took_at_its_version(
    staleness, publish_every, steps_since, pending, rate, expected
):
    capacity = admission_capacity(
        max_staleness=staleness,
        publish_every=publish_every,
        batch_groups=4,
        learner_version=3,
        generator_version=3,
        accept_rate=rate,
        steps_since_publish=steps_since,
        pending_accepted=pending,
    )
    assert capacity == pytest.approx(expected)


def test_synchronous_gate_refuses_while_the_learner_trains_on_a_full_batch(
    run_location: Location,
):
    """max_staleness=0: a waiting record at the end of the stream (the reader idles while the
    step trains) no longer reads as a learner that needs a whole step's groups at its version;
    they would all be stale once it publishes."""
    learner = LearnerConfig(batch_groups=4, mini_batch_groups=4, max_staleness=0)
    gate = FlowGate(run_location, learner, "gen0")
    writer = StreamWriter(run_location, "gen0")
    _commit(writer, np.random.default_rng(0), 5)  # record 0: the step's 5 groups
    trains = _progress(5, 4, cursor=Cursor(seq=1), waiting=True, pending_accepted=4)
    write_learner_progress(run_location, trains)
    gate.refresh()
    assert gate.backlog == 0
    assert not gate.admits(generator_version=1, uncommitted=0)
    one_short = replace(trains, pending_accepted=3)  # 3 of 4 accepted; a = 4/5: 1.25 groups
    write_learner_progress(run_location, one_short)
    gate.refresh()
    assert gate.admits(generator_version=1, uncommitted=1)
    assert not gate.admits(generator_version=1, uncommitted=2)


def _progress(consumed_total: int, accepted_total: int, **kwargs) -> LearnerProgress:
    return LearnerProgress(
        step=1, policy_version=1, consumed_total=consumed_total, accepted_total=accepted_total,
        **kwargs,
    )  # fmt: skip


def test_accept_rate_is_measured_floored_and_one_before_data():
    assert accept_rate(None) == 1.0
    assert accept_rate(_progress(0, 0)) == 1.0
    assert accept_rate(_progress(40, 30)) == pytest.approx(0.75)
    assert accept_rate(_progress(1000, 1)) == pytest.approx(0.05)


def test_length_aware_batches_measure_the_groups_a_step_takes():
    fixed = LearnerConfig(batch_groups=8, mini_batch_groups=8)
    by_tokens = LearnerConfig(batch_groups=8, mini_batch_groups=8, batch_tokens=4096)
    ran = LearnerProgress(step=4, policy_version=4, consumed_total=40, accepted_total=12)
    assert groups_per_step(ran, fixed) == 8.0
    assert groups_per_step(None, by_tokens) == 8.0  # before the first step: at most B
    assert groups_per_step(ran, by_tokens) == 3.0
    many = LearnerProgress(step=1, policy_version=1, consumed_total=40, accepted_total=30)
    assert groups_per_step(many, by_tokens) == 8.0  # never above B


def test_stale_drops_do_not_lower_the_accept_rate():
    """Found by benchmarks/fleet_bench.py: counting stale drops as rejections raised the
    capacity whenever the fleet over-produced, and the backlog grew with it."""
    assert accept_rate(_progress(90, 64, dropped_stale_total=26)) == 1.0
    rejected_too = _progress(90, 32, dropped_stale_total=26)
    assert accept_rate(rejected_too) == pytest.approx(0.5)  # 32 of the 64 fresh groups
    assert accept_rate(_progress(20, 0, dropped_stale_total=20)) == 1.0


def _commit(writer: StreamWriter, rng: np.random.Generator, n: int) -> None:
    writer.write([random_group(rng, prompt_id=f"p{i}") for i in range(n)])


def test_gate_counts_the_backlog_after_the_learners_cursor_and_pauses(run_location: Location):
    learner = LearnerConfig(batch_groups=2, mini_batch_groups=2, max_staleness=1, publish_every=1)
    gate = FlowGate(run_location, learner, "gen0")
    writer = StreamWriter(run_location, "gen0")
    rng = np.random.default_rng(0)
    # No learner record yet: cursor 0, version 0, accept rate 1 → capacity (1+1) × 2 = 4.
    assert gate.admits(generator_version=0, uncommitted=3)
    for n in (3, 2, 4):  # commit records 0, 1, 2
        _commit(writer, rng, n)
    gate.refresh()
    assert gate.backlog == 9
    assert not gate.admits(generator_version=0, uncommitted=0)
    assert gate.paused

    # The learner consumed record 0 and one group of record 1; half of what it read it kept:
    # backlog 1 + 4 = 5, capacity (1 + 1 − 0) × 2 / 0.5 = 8 at version 1 with weights v1.
    write_learner_progress(
        run_location, _progress(4, 2, cursor=Cursor(seq=1, offset=1), consumed=4, accepted=2)
    )
    gate.refresh()
    assert gate.backlog == 5
    assert gate.admits(generator_version=1, uncommitted=2)
    assert not gate.paused
    assert gate.paused_s > 0
    assert not gate.admits(generator_version=1, uncommitted=3)
    assert not gate.admits(generator_version=0, uncommitted=0)  # lag 1: capacity 4

    gate.committed(3)  # our own commit counts before the next refresh reads it
    assert gate.backlog == 8
    _commit(writer, rng, 3)  # record 3, that commit
    gate.refresh()
    assert gate.backlog == 8

    disabled = FlowGate(run_location, learner, "gen0", enabled=False)
    assert disabled.admits(generator_version=0, uncommitted=10**6)
    assert disabled.paused_s == 0.0


def test_a_bare_yaml_off_turns_flow_control_off():
    config = load_config(["dapo", "tiny-cpu"], overrides=["generator.flow_control=off"])
    assert config.generator.flow_control == "off"
    assert load_config(["dapo"]).generator.flow_control == "staleness"  # the default
    on = load_config(["dapo"], overrides=["generator.flow_control=staleness"])
    assert on.generator.flow_control == "staleness"
