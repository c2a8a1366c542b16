"""The streamrl-vs-TRL comparison (`benchmarks/trl_bench.py`): the steady mean leaves the warm-up
step out, the ratios and their verdicts are streamrl / TRL against issue #61's goals, and a
side's record from an earlier invocation is reused only for the same shape. No TRL needed."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks.trl_bench import compare, load_earlier, side_record, table


def args(**changes: int) -> argparse.Namespace:
    shape = {"steps": 3, "prompts": 8, "samples": 8, "max_tokens": 128, "seed": 0}
    return argparse.Namespace(**(shape | changes))


def test_the_steady_mean_leaves_the_first_step_out() -> None:
    record = side_record(args(), [90.0, 10.0, 14.0], wall_s=200.0)
    assert record["steady_s"] == pytest.approx(12.0)
    assert record["steps_s"] == [90.0, 10.0, 14.0]
    assert record["shape"]["steps"] == 3


def test_ratios_are_streamrl_over_trl_and_a_goal_is_met_at_its_bound() -> None:
    trl = side_record(args(), [50.0, 10.0, 10.0], wall_s=100.0)
    ours = side_record(args(), [20.0, 4.0, 4.0], wall_s=61.0)
    result = compare(trl, ours)
    assert result["ratios"] == pytest.approx({"steady_step": 0.4, "whole_run": 0.61})
    assert result["met"] == {"steady_step": True, "whole_run": False}


def test_the_table_names_a_reused_side_and_each_verdict() -> None:
    trl = side_record(args(), [50.0, 10.0, 10.0], wall_s=100.0, version="1.16.0")
    ours = side_record(args(), [20.0, 2.0, 3.0], wall_s=50.0, consumed_groups=[9, 8])
    lines = table({"trl": trl, "streamrl": ours}, {"trl": "2026-01-01T00:00:00Z"})
    rows = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ")}
    assert "TRL GRPOTrainer 1.16.0 (earlier run, 2026-01-01T00:00:00Z)" in rows
    assert "| 20.0 | 2.0 | 3.0 | 2.5 | 50 |" in rows["streamrl"]
    assert "streamrl / TRL, steady step: 0.250 (goal ≤ 0.4: met)" in lines
    assert "streamrl / TRL, whole run: 0.500 (goal ≤ 0.6: met)" in lines
    assert any(line.endswith("[9, 8]") for line in lines)


def test_an_earlier_record_of_another_shape_is_refused(tmp_path) -> None:
    earlier = side_record(args(max_tokens=16), [5.0, 1.0, 1.0], wall_s=20.0)
    (tmp_path / "trl.json").write_text(json.dumps(earlier))
    assert load_earlier(tmp_path, "trl", args(max_tokens=16)) == earlier
    with pytest.raises(SystemExit, match="rerun --parts trl"):
        load_earlier(tmp_path, "trl", args())
    with pytest.raises(SystemExit, match="no earlier streamrl record"):
        load_earlier(tmp_path, "streamrl", args())
