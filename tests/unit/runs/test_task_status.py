"""Per-task accuracy where a run reports it: `streamrl status` (`StreamStatus.tasks`, summed from
the commit log incrementally, and its "tasks" row), the learner's step line
(`task_accuracies`), and the evaluator's per-task metrics (`_per_task`)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from storage.stream.records import MAX_TASKS, OTHER_TASKS, ScoredGroup
from storage.stream.writer import StreamWriter
from streamrl.data.datasets import Prompt
from streamrl.evaluation.evaluator import _per_task
from streamrl.learner.reporting import task_accuracies
from streamrl.runs.status import read_status, read_stream
from streamrl.runs.status_format import format_status, to_json
from tests.unit.runs.built_runs import group, new_run


def _task(i: int, scores: list[float], task: str | None, level: int | None = 0) -> ScoredGroup:
    made = group(i, 0, scores)
    return ScoredGroup(**{**made.__dict__, "task": task, "task_level": level if task else None})


def test_stream_status_sums_each_tasks_responses_across_reads(tmp_path):
    run, _ = new_run(tmp_path / "run")
    writer = StreamWriter(run, "gen0")
    writer.write([_task(0, [1, 0, 1, 0], "leg_counting"), _task(1, [1, 1, 1, 1], None)])
    first = read_stream(run)
    assert first.tasks == (("leg_counting", 4, 2),)
    writer.write([_task(2, [1, 1, 0, 0], "leg_counting"), _task(3, [0, 0, 0, 1], "chain_sum")])
    writer.write([_task(4, [1, 0, 0, 0], "chain_sum")])
    later = read_stream(run, since=first)
    assert later.tasks == (("chain_sum", 8, 2), ("leg_counting", 8, 4))  # in name order
    assert read_stream(run) == later  # read from the start: the same counts
    assert read_stream(run, since=later).tasks == later.tasks  # nothing new: nothing added


def test_stream_status_caps_the_tasks_it_counts_apart(tmp_path):
    run, _ = new_run(tmp_path / "run")
    writer = StreamWriter(run, "gen0")
    writer.write([_task(i, [1, 0], f"t{i:03d}") for i in range(MAX_TASKS)])
    seen = read_stream(run)
    writer.write([_task(100, [1, 1], "late"), _task(101, [0, 0], "t000")])
    tasks = {t: (n, c) for t, n, c in read_stream(run, since=seen).tasks}
    assert len(tasks) == MAX_TASKS + 1
    assert tasks[OTHER_TASKS] == (2, 2)
    assert "late" not in tasks
    assert tasks["t000"] == (4, 1)


def test_status_shows_a_tasks_row_with_the_last_steps_accuracy(tmp_path):
    run, _ = new_run(tmp_path / "run")
    StreamWriter(run, "gen0").write(
        [_task(0, [1, 0, 1, 0], "leg_counting"), _task(1, [1, 1, 1, 0], "chain_sum")]
    )
    status = read_status(run)
    lines = format_status(status).splitlines()
    assert "tasks      chain_sum: acc 0.750 over 4 responses" in lines
    assert "           leg_counting: acc 0.500 over 4 responses" in lines
    assert json.loads(to_json(status))["stream"]["tasks"] == [
        ["chain_sum", 4, 3], ["leg_counting", 4, 2],
    ]  # fmt: skip
    stepped = replace(status, last_metrics={"task/leg_counting/acc": 0.25, "step": 3})
    lines = format_status(stepped).splitlines()
    assert "           leg_counting: acc 0.500 over 4 responses, last step 0.250" in lines
    assert "tasks      chain_sum: acc 0.750 over 4 responses" in lines
    plain_run, _ = new_run(tmp_path / "plain")
    StreamWriter(plain_run, "gen0").write([_task(0, [1, 0], None)])
    assert not [line for line in format_status(read_status(plain_run)).splitlines()
                if line.startswith("tasks")]  # fmt: skip


def test_the_step_line_names_each_tasks_accuracy_when_there_are_two_or_more():
    metrics = {"rollout/acc": 0.5, "task/leg_counting/acc": 0.412, "task/chain_sum/acc": 0.2,
               "task_accepted/leg_counting/acc": 0.9}  # fmt: skip
    assert task_accuracies(metrics) == " (chain_sum 0.20, leg_counting 0.41)"
    assert task_accuracies({"task/leg_counting/acc": 0.4}) == ""  # one task: the acc already
    assert task_accuracies({"rollout/acc": 0.5}) == ""
    many = {f"task/t{i}/acc": i / 10 for i in range(8)}
    assert task_accuracies(many) == (
        " (t0 0.00, t1 0.10, t2 0.20, t3 0.30, t4 0.40, t5 0.50, +2 more)"
    )
    assert task_accuracies(many, shown=2) == " (t0 0.00, t1 0.10, +6 more)"
    assert task_accuracies(metrics, prefix="task_accepted") == ""


def _prompt(i: int, task: str | None) -> Prompt:
    return Prompt(f"p:{i}", "q", [1], "a", (), task, 0 if task else None)


def test_the_evaluator_breaks_accuracy_down_per_task():
    prompts = [_prompt(0, "leg_counting"), _prompt(1, "chain_sum"), _prompt(2, "leg_counting"),
               _prompt(3, None)]  # fmt: skip
    greedy = np.array([True, False, False, True])
    samples = np.array([[1, 1], [0, 1], [0, 0], [1, 1]], dtype=bool)
    assert _per_task(prompts, greedy, samples) == {
        "val/chain_sum/acc_greedy": 0.0,
        "val/chain_sum/pass@1": 0.5,
        "val/chain_sum/num_prompts": 1.0,
        "val/leg_counting/acc_greedy": 0.5,
        "val/leg_counting/pass@1": 0.5,
        "val/leg_counting/num_prompts": 2.0,
    }
    one_task = [_prompt(i, "leg_counting") for i in range(4)]
    assert _per_task(one_task, greedy, samples) == {}
    assert _per_task([_prompt(i, None) for i in range(4)], greedy, samples) == {}


@pytest.mark.parametrize("k", [1, 4])
def test_per_task_pass_at_1_averages_the_samples(k):
    prompts = [_prompt(0, "a"), _prompt(1, "b")]
    samples = np.zeros((2, k), dtype=bool)
    samples[0, 0] = True
    metrics = _per_task(prompts, np.array([True, True]), samples)
    assert metrics["val/a/pass@1"] == pytest.approx(1 / k)
    assert metrics["val/b/pass@1"] == 0.0
