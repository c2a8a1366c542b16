"""The curves' data (steps, values, missing metrics, non-finite values, resumed runs whose steps
repeat — the last record wins), text charts and the image; `MetricsFollower` reads only what
was logged since its last read, on a local run and on S3."""

from __future__ import annotations

import io
import json
import math
from types import SimpleNamespace

import pytest
from PIL import Image

from storage.fs import open_location
from streamrl.learner.config import LoggingConfig
from streamrl.learner.reporting import MetricsReporter
from streamrl.learner.metrics_records import MetricsFollower
from streamrl.runs.curves import RunCurves, curve_data, render_png, sparkline, text_charts
from streamrl.runs.status_format import _metrics_rows


def _record(step: int, reward: float, **more: object) -> dict:
    return {"step": step, "rollout/reward_mean": reward, **more}


def test_series_hold_each_step_once_and_the_last_record_of_a_repeated_step_wins():
    records = [
        {"step": 0, "value_pretrain_step": 1, "critic/vf_loss": 3.0},  # not a learner step
        _record(1, -1.0, **{"rollout/acc": 0.1}),
        _record(2, -0.5),  # no accuracy logged at this step
        _record(3, -0.2, **{"rollout/acc": float("nan")}),  # not finite: left out
        # A learner resumed from its step-1 checkpoint logs steps 2 and 3 again.
        _record(2, -0.4, **{"rollout/acc": 0.3}),
        _record(3, -0.1, **{"rollout/acc": 0.4}),
        _record(4, 0.0, **{"actor/entropy": True}),  # not a number
    ]
    curves = curve_data(records)
    assert curves.series["rollout/reward_mean"] == ([1, 2, 3, 4], [-1.0, -0.4, -0.1, 0.0])
    assert curves.series["rollout/acc"] == ([1, 2, 3], [0.1, 0.3, 0.4])
    assert "actor/entropy" not in curves.series
    assert "critic/vf_loss" not in curves.series
    assert (curves.first_step, curves.last_step) == (1, 4)


def test_evaluations_sit_at_the_step_of_the_weights_and_health_marks_are_kept():
    records = [
        _record(1, -1.0),
        _record(2, -0.5, health=[{"condition": "waste-high", "step": 2}]),
        _record(3, -0.2, health=[{"condition": "kl-high"}, {"condition": "length-runaway"}]),
    ]
    evaluations = [
        {"version": 0, "val/acc_greedy": 0.1, "val/avg@4": 0.2, "val/num_prompts": 64.0},
        {"version": 2, "val/acc_greedy": 0.2, "val/avg@4": 0.25},
        {"version": 2, "val/acc_greedy": 0.3, "val/avg@4": 0.35},  # evaluated again
    ]
    curves = curve_data(records, evaluations)
    assert curves.evaluations == {
        "val/acc_greedy": ([0, 2], [0.1, 0.3]),
        "val/avg@4": ([0, 2], [0.2, 0.35]),
    }  # prompt counts are not scores
    assert curves.health == [(2, "waste-high"), (3, "kl-high"), (3, "length-runaway")]


def test_no_records_make_empty_curves():
    curves = curve_data([])
    assert not curves
    assert curves.last_step == 0
    assert text_charts(curves) == []


def test_sparkline_scales_between_the_lowest_and_highest_value():
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7]) == "▁▂▃▄▅▆▇█"
    assert sparkline([5.0, 5.0, 5.0]) == "▄▄▄"  # flat: mid height
    assert sparkline([]) == ""
    # 80 points on 40 columns: each column is the mean of two points
    assert sparkline([0, 0] * 20 + [7, 7] * 20, width=40) == "▁" * 20 + "█" * 20


def test_text_charts_show_first_last_range_evaluations_and_health():
    records = [
        _record(s, -1 + s / 10, **{"rollout/acc": s / 20, "rollout_accepted/acc": s / 10})
        for s in range(1, 11)
    ]
    records[4]["health"] = [{"condition": "entropy-collapse"}]
    curves = curve_data(records, [{"version": 10, "val/acc_greedy": 0.5}])
    lines = text_charts(curves)
    reward = next(line for line in lines if line.startswith("reward (mean)"))
    assert "▁" in reward
    assert "█" in reward
    assert "-0.900 → +0.000  [-0.900 .. +0.000]" in reward
    assert any(line.startswith("accuracy (trained groups)") for line in lines)
    assert any(line.startswith("held-out acc_greedy") for line in lines)
    assert lines[-1] == "health: entropy-collapse at step 5"
    only = text_charts(curves, titles=("reward (mean)",))
    assert len(only) == 1


def test_the_image_is_a_png_of_every_chart_with_data():
    records = [
        _record(s, math.sin(s), **{"rollout/acc": s / 50, "actor/entropy": 1 / s})
        for s in range(1, 51)
    ]
    records[20]["health"] = [{"condition": "entropy-collapse"}]
    png = render_png(curve_data(records, [{"version": 25, "val/acc_greedy": 0.4}]), "run")
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG"
    assert image.size[0] >= 600
    assert image.size[1] >= 300
    empty = Image.open(io.BytesIO(render_png(curve_data([]))))
    assert empty.format == "PNG"


def test_follower_reads_only_new_records_and_waits_for_a_line_being_written(tmp_path):
    run = open_location(str(tmp_path / "run"))
    follower = MetricsFollower(run)
    assert follower.read() == []  # no metrics yet
    jsonl = tmp_path / "run" / "metrics" / "learner.jsonl"
    jsonl.parent.mkdir(parents=True)
    jsonl.write_text(json.dumps(_record(1, -1.0)) + "\n" + '{"step": 2, "rollout/rew')
    assert [r["step"] for r in follower.read()] == [1]  # the cut line is not read yet
    with jsonl.open("a") as f:
        f.write('ard_mean": -0.5}\n' + json.dumps(_record(3, 0.0)) + "\n")
    assert [r["step"] for r in follower.read()] == [2, 3]
    assert follower.read() == []


def test_run_curves_follow_a_run_on_s3(seaweedfs, tmp_path):
    """On an object store each record is an object; a second read fetches only new ones."""
    run = open_location(
        f"s3://{seaweedfs.bucket}/runs/curves-{tmp_path.name}",
        storage_options=seaweedfs.storage_options,
    )
    logging = LoggingConfig(wandb_mode="disabled", log_every=1)
    reporter = MetricsReporter(run, logging, config={}, total_steps=4)
    history = RunCurves(run)
    for step in (1, 2):
        reporter.log(_record(step, step / 10))
    assert [r["step"] for r in history.read()] == [1, 2]
    reporter.log(_record(3, 0.3))
    reporter.log(_record(2, 0.25))  # logged again by a resumed learner
    assert [r["step"] for r in history.read()] == [2, 3]
    assert history.curves().series["rollout/reward_mean"] == ([1, 2, 3], [0.1, 0.25, 0.3])


@pytest.mark.parametrize("width", [8, 40])
def test_sparkline_never_exceeds_its_width(width):
    assert len(sparkline([float(i % 7) for i in range(1000)], width=width)) == width


def test_the_policy_losses_clipping_is_charted_and_in_the_status_table():
    """actor/clip_frac (whatever the loss counts: tokens, responses or truncated weights) and
    SAPO's actor/gate_weight_mean have a chart and a place in `streamrl status`."""
    records = [
        _record(s, 0.0, **{"actor/clip_frac": s / 100, "actor/gate_weight_mean": 1 - s / 100})
        for s in range(1, 6)
    ]
    lines = text_charts(curve_data(records))
    assert any(line.startswith("policy-loss clipping (clipped fraction)") for line in lines)
    gate = next(line for line in lines if "SAPO gate weight" in line)
    assert "0.990 → 0.950" in gate
    shown = dict(_metrics_rows(SimpleNamespace(last_metrics=records[-1], read_at=0.0)))
    assert "clipped 0.050" in shown[""]
    assert "gate 0.950" in shown[""]
