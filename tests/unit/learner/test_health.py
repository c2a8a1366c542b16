"""Health conditions: each fires at the right step with its value and threshold, edge-triggered,
skips missing metrics, carries on from seeded records; the config rejects bad thresholds."""

from __future__ import annotations

import json
import statistics

import pytest

from streamrl.config.base import ConfigError
from streamrl.config.loading import load_config
from streamrl.learner.config import HealthConfig
from streamrl.learner.health import CONDITIONS, HealthEvent, HealthMonitor


def monitor(max_tokens: int = 100, max_staleness: int = 4, **fields) -> HealthMonitor:
    return HealthMonitor(HealthConfig(**fields), max_tokens=max_tokens, max_staleness=max_staleness)


def run(mon: HealthMonitor, metric: str, values: list[float]) -> list[HealthEvent]:
    """Steps 1, 2, ... with `metric` taking `values`; every event they set off."""
    events = []
    for step, value in enumerate(values, start=1):
        events += mon.check({"step": step, metric: value})
    return events


def unnamed(event: HealthEvent, *parts: str) -> list[str]:
    """The parts its message does not mention."""
    return [part for part in parts if part not in event.message]


def only(events: list[HealthEvent]) -> HealthEvent:
    assert len(events) == 1, events
    return events[0]


# --- each condition ------------------------------------------------------------------------


def test_entropy_collapse_against_the_baseline_of_the_first_steps() -> None:
    first = [1.0, 1.2, 0.8, 1.1, 0.9]  # baseline: their mean, 1.0; threshold 0.2 × 1.0
    mon = monitor(entropy_collapse_ratio=0.2, baseline_steps=5)
    event = only(run(mon, "actor/entropy", [*first, 0.5, 0.21, 0.19]))
    assert (event.condition, event.step, event.value) == ("entropy-collapse", 8, 0.19)
    assert event.threshold == pytest.approx(0.2 * statistics.fmean(first))
    assert unnamed(event, "actor/entropy", "0.19", "0.2", "health.entropy_collapse_ratio") == []


def test_entropy_below_the_minimum_fires_even_during_the_baseline() -> None:
    mon = monitor(entropy_min=0.02)
    event = only(run(mon, "actor/entropy", [0.5, 0.03, 0.015]))
    assert (event.step, event.value, event.threshold) == (3, 0.015, 0.02)
    assert "health.entropy_min" in event.message


def test_entropy_minimum_wins_when_it_is_above_the_relative_threshold() -> None:
    mon = monitor(entropy_min=0.05, entropy_collapse_ratio=0.2, baseline_steps=2)
    event = only(run(mon, "actor/entropy", [0.1, 0.1, 0.04]))  # 0.2 × 0.1 = 0.02 < 0.05
    assert (event.step, event.threshold) == (3, 0.05)


def test_kl_high_above_kl_max() -> None:
    event = only(run(monitor(kl_max=0.1), "actor/ref_kl", [0.05, 0.1, 0.12]))
    assert (event.condition, event.step, event.value, event.threshold) == (
        "kl-high",
        3,
        0.12,
        0.1,
    )
    assert unnamed(event, "actor/ref_kl", "0.12", "0.1", "health.kl_max") == []


def test_grad_norm_spike_against_the_median_of_the_previous_window() -> None:
    norms = [1.0, 2.0, 1.5, 1.0, 3.0]  # median 1.5: 7.5 is at 5 × 1.5, not above
    mon = monitor(grad_norm_spike=5.0, grad_norm_window=20)
    event = only(run(mon, "actor/grad_norm", [*norms, 7.5, 8.8]))  # now 5 × 1.75
    assert (event.condition, event.step, event.value) == ("grad-norm-spike", 7, 8.8)
    assert event.threshold == pytest.approx(5.0 * statistics.median([*norms, 7.5]))
    assert "health.grad_norm_spike" in event.message


def test_grad_norm_spike_needs_five_previous_norms_and_uses_only_the_window() -> None:
    assert run(monitor(), "actor/grad_norm", [1.0, 1.0, 1.0, 1.0, 100.0]) == []
    # The window holds the last 5: the early large norms no longer raise the median.
    mon = monitor(grad_norm_spike=2.0, grad_norm_window=5)
    norms = [10.0, 10.0, 10.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0]
    event = only(run(mon, "actor/grad_norm", norms))
    assert (event.step, event.threshold) == (9, 2.0)


def test_grad_norm_spike_skips_non_finite_norms() -> None:
    """A NaN/inf norm is a skipped update (non-finite-update), not a spike, and stays out of
    the window."""
    mon = monitor(grad_norm_spike=5.0)
    norms = [1.0] * 5 + [float("inf"), float("nan"), 5.5]
    event = only(run(mon, "actor/grad_norm", norms))
    assert (event.step, event.threshold) == (8, 5.0)


def test_length_runaway_at_the_fraction_of_max_tokens() -> None:
    mon = monitor(max_tokens=200, length_frac=0.9)
    event = only(run(mon, "rollout/response_len_mean", [120.0, 179.9, 180.0]))
    assert (event.condition, event.step, event.value, event.threshold) == (
        "length-runaway",
        3,
        180.0,
        180.0,
    )
    assert unnamed(event, "health.length_frac", "generator.max_tokens=200") == []


def test_non_finite_update_on_any_skipped_update() -> None:
    event = only(run(monitor(), "actor/skipped_updates", [0.0, 2.0]))
    assert (event.condition, event.step, event.value, event.threshold) == (
        "non-finite-update",
        2,
        2.0,
        0.0,
    )
    assert "learner.lr" in event.message


def test_waste_high_above_waste_max() -> None:
    event = only(run(monitor(waste_max=0.5), "stream/waste_frac", [0.2, 0.5, 0.6]))
    assert (event.condition, event.step, event.value, event.threshold) == (
        "waste-high",
        3,
        0.6,
        0.5,
    )
    assert "health.waste_max" in event.message


def test_staleness_at_the_bound() -> None:
    event = only(run(monitor(max_staleness=4), "stream/staleness_max", [2.0, 3.0, 4.0]))
    assert (event.condition, event.step, event.value, event.threshold) == (
        "staleness-at-bound",
        3,
        4.0,
        4.0,
    )
    assert "learner.max_staleness" in event.message


def test_mismatch_high_on_the_fresh_group_kl() -> None:
    """Only the fresh-group KL counts: a large KL over stale groups is staleness, not a
    broken engine."""
    mon = monitor(mismatch_kl_max=0.01)
    assert mon.check({"step": 1, "mismatch/kl_k3": 0.5, "mismatch/kl_k3_fresh": 0.002}) == []
    event = only(run(mon, "mismatch/kl_k3_fresh", [0.005, 0.02]))
    assert (event.condition, event.value, event.threshold) == ("mismatch-high", 0.02, 0.01)
    assert "health.mismatch_kl_max" in event.message


def test_staleness_is_not_checked_on_policy() -> None:
    """max_staleness 0: every group is at the bound by construction."""
    assert run(monitor(max_staleness=0), "stream/staleness_max", [0.0, 0.0]) == []


# --- edge-triggering, missing metrics, seeding ---------------------------------------------


def test_a_condition_fires_once_and_again_only_after_it_cleared() -> None:
    events = run(monitor(waste_max=0.5), "stream/waste_frac", [0.6, 0.7, 0.8, 0.4, 0.9, 0.9])
    assert [(e.step, e.value) for e in events] == [(1, 0.6), (5, 0.9)]


def test_a_step_without_the_metric_neither_fires_nor_clears() -> None:
    mon = monitor(kl_max=0.1)
    assert mon.check({"step": 1, "actor/ref_kl": 0.2})[0].condition == "kl-high"
    assert mon.check({"step": 2}) == []  # absent: not evaluated
    assert mon.check({"step": 3, "actor/ref_kl": float("nan")}) == []
    assert mon.check({"step": 4, "actor/ref_kl": 0.3}) == []  # still the same episode


def test_several_conditions_fire_in_one_step() -> None:
    mon = monitor(max_tokens=10)
    events = mon.check(
        {
            "step": 1,
            "actor/entropy": 0.001,
            "actor/ref_kl": 0.5,
            "rollout/response_len_mean": 10.0,
            "actor/skipped_updates": 1.0,
            "stream/waste_frac": 0.9,
            "stream/staleness_max": 4.0,
            "mismatch/kl_k3_fresh": 0.5,
        }
    )
    expected = [c for c in CONDITIONS if c not in ("grad-norm-spike", "tools-unused")]
    assert [e.condition for e in events] == expected


def test_tools_unused_fires_after_steps_without_a_call_only_where_tools_are_offered() -> None:
    mon = monitor(tools_unused_steps=3)
    offered = {"rollout/tools_offered_frac": 1.0}
    calls = [0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0]  # a call at step 3 restarts the count
    events = [e for i, c in enumerate(calls, 1)
              for e in mon.check({"step": i, "rollout/tool_calls_mean": c, **offered})]  # fmt: skip
    assert [(e.condition, e.step) for e in events] == [("tools-unused", 6)]
    assert "no tool call for 3 steps in a row (health.tools_unused_steps=3)" in events[0].message
    assert "streamrl sft" in events[0].message
    # An environment without tools (single-turn, or multi-turn without tools) never fires it.
    quiet = monitor(tools_unused_steps=1)
    assert all(quiet.check({"step": i, "rollout/tool_calls_mean": 0.0}) == [] for i in (1, 2))


def test_disabled_checks_nothing() -> None:
    mon = monitor(enabled=False)
    assert mon.check({"step": 1, "stream/waste_frac": 1.0, "actor/skipped_updates": 3.0}) == []


def test_seeded_records_continue_the_baselines_without_emitting() -> None:
    earlier = [
        {"step": 0, "value_pretrain_step": 1, "actor/entropy": 50.0},  # value pre-training
        *({"step": s, "actor/entropy": 1.0, "actor/grad_norm": 1.0} for s in range(1, 6)),
    ]
    mon = monitor()
    mon.seed(earlier)
    events = mon.check({"step": 6, "actor/entropy": 0.19, "actor/grad_norm": 5.1})
    assert [(e.condition, e.threshold) for e in events] == [
        ("entropy-collapse", pytest.approx(0.2)),  # baseline 1.0, not 50
        ("grad-norm-spike", 5.0),
    ]


def test_a_condition_that_held_when_seeded_fires_only_after_clearing() -> None:
    mon = monitor(waste_max=0.5)
    mon.seed([{"step": 1, "stream/waste_frac": 0.7}, {"step": 2, "stream/waste_frac": 0.8}])
    assert mon.check({"step": 3, "stream/waste_frac": 0.8}) == []
    assert mon.check({"step": 4, "stream/waste_frac": 0.4}) == []
    assert only(mon.check({"step": 5, "stream/waste_frac": 0.6})).step == 5


def test_event_record_is_plain_json_and_round_trips() -> None:
    event = only(monitor().check({"step": 7, "stream/waste_frac": 0.75}))
    record = json.loads(json.dumps(event.as_record()))
    assert set(record) == {"condition", "step", "value", "threshold", "message"}
    assert (record["condition"], record["step"], record["value"]) == ("waste-high", 7, 0.75)
    assert HealthEvent.from_record(record) == event


# --- config --------------------------------------------------------------------------------


def test_health_defaults_and_overrides() -> None:
    config = load_config(overrides=["health.kl_max=0.2", "health.grad_norm_window=30"])
    assert (config.health.kl_max, config.health.grad_norm_window) == (0.2, 30)
    assert config.health.enabled
    assert (config.health.entropy_collapse_ratio, config.health.waste_max) == (0.2, 0.5)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("health.entropy_collapse_ratio=1.5", "health.entropy_collapse_ratio"),
        ("health.kl_max=0", "health.kl_max"),
        ("health.grad_norm_spike=0.5", "health.grad_norm_spike"),
        ("health.grad_norm_window=3", "health.grad_norm_window"),
        ("health.length_frac=1.2", "health.length_frac"),
        ("health.waste_max=-0.1", "health.waste_max"),
        ("health.baseline_steps=0", "health.baseline_steps"),
        ("health.entropy_minimum=0.1", "health.entropy_minimum"),
    ],
)
def test_bad_health_settings_are_rejected_naming_the_field(override: str, field: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(overrides=[override])
    assert excinfo.value.problems[0].startswith(f"{field}: ")
    if field == "health.entropy_minimum":
        assert "Did you mean 'entropy_min'?" in excinfo.value.problems[0]
