"""A group's task (`ScoredGroup.task`, `task_level`): its invariants, its segment attributes
(`tasks`, `task_levels`, absent where no group has a task), and the per-task counts of the
rollout sums (`task_responses`, `task_correct`): metrics, merging, the `MAX_TASKS` cap, old
records without them and the commit record's checks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from storage.stream.records import (
    MAX_TASKS,
    OTHER_TASKS,
    CommitRecord,
    InvalidRecordError,
    RolloutSums,
    ScoredGroup,
)
from storage.stream.segments import CorruptSegmentError, decode_segment, encode_segment
from tests.stream_data import random_group


def _with(group: ScoredGroup, **changes) -> ScoredGroup:
    return ScoredGroup(**{**group.__dict__, **changes})


def _scored(i: int, scores: list[float], task: str | None = None, level: int | None = None):
    made = random_group(np.random.default_rng(i), prompt_id=f"p{i}", group_size=len(scores))
    raw = np.asarray(scores, np.float32)
    return _with(made, raw_scores=raw, rewards=2 * raw - 1, task=task, task_level=level)


def _root(objects: dict[str, bytes]) -> dict:
    return json.loads(objects["zarr.json"])


def _with_attrs(objects: dict[str, bytes], **attrs) -> dict[str, bytes]:
    root = _root(objects)
    root["attributes"].update(attrs)
    return {**objects, "zarr.json": json.dumps(root).encode()}


# --- the group and its segment ---------------------------------------------------------------


def test_tasks_round_trip_through_a_segment():
    groups = [
        _scored(0, [1, 0, 1, 0], "leg_counting", 0),
        _scored(1, [0, 0, 1, 1]),  # no task: the other groups of its segment have one
        _scored(2, [1, 1, 1, 1], "openai_gsm8k"),  # a task without a level
        _scored(3, [0, 1, 0, 0], "basic_arithmetic", 3),
    ]
    objects = encode_segment(groups)
    attributes = _root(objects)["attributes"]
    assert attributes["tasks"] == ["leg_counting", None, "openai_gsm8k", "basic_arithmetic"]
    assert attributes["task_levels"] == [0, None, None, 3]
    decoded = decode_segment(objects)
    assert all(a.equals(b) for a, b in zip(groups, decoded, strict=True))
    assert [(g.task, g.task_level) for g in decoded] == [
        ("leg_counting", 0), (None, None), ("openai_gsm8k", None), ("basic_arithmetic", 3),
    ]  # fmt: skip


def test_a_segment_without_tasks_has_no_task_attributes_and_decodes_none():
    objects = encode_segment([_scored(0, [1, 0]), _scored(1, [0, 1])])
    assert not {"tasks", "task_levels"} & set(_root(objects)["attributes"])
    assert [(g.task, g.task_level) for g in decode_segment(objects)] == [(None, None)] * 2


def test_equals_sees_the_task_and_its_level():
    group = _scored(0, [1, 0], "leg_counting", 1)
    assert group.equals(_with(group))
    assert not group.equals(_with(group, task="chain_sum"))
    assert not group.equals(_with(group, task=None, task_level=None))
    assert not group.equals(_with(group, task_level=2))


@pytest.mark.parametrize(
    "task", ["", "_x", "-x", "a/b", "a b", "é", "x" * 65, 5, b"leg_counting"], ids=repr
)
def test_validate_rejects_a_task_that_is_no_metric_name(task):
    with pytest.raises(InvalidRecordError, match=r"'p0'.*task .* must match"):
        _scored(0, [1, 0], task).validate()


def test_validate_accepts_task_names_up_to_64_characters():
    for task in ("a", "openai_gsm8k", "math-dapo.v2", "A" * 64, "9x"):
        _scored(0, [1, 0], task, 0).validate()


def test_validate_rejects_a_level_without_a_task_or_not_a_whole_number_at_least_0():
    with pytest.raises(InvalidRecordError, match="task_level is given without a task"):
        _scored(0, [1, 0], None, 0).validate()
    for level in (-1, True, False, 1.0, "1", np.int64(1)):
        with pytest.raises(InvalidRecordError, match="task_level must be an int ≥ 0"):
            _scored(0, [1, 0], "leg_counting", level).validate()


def test_encoding_refuses_an_invalid_task():
    with pytest.raises(InvalidRecordError, match="task"):
        encode_segment([_scored(0, [1, 0], "a/b")])


@pytest.mark.parametrize(
    "attrs",
    [
        {"tasks": ["leg_counting"]},  # one for two groups
        {"tasks": ["leg_counting", "chain_sum", "x"]},
        {"tasks": "leg_counting"},
        {"tasks": ["leg_counting", 5]},
        {"tasks": {"0": "leg_counting"}},
        {"task_levels": [0]},
        {"task_levels": [0, "1"]},
        {"task_levels": [0, True]},
        {"task_levels": [0, 1.5]},
        {"tasks": ["leg_counting", "a/b"]},  # no task name
        {"task_levels": [0, -1]},
        {"tasks": [None, "chain_sum"], "task_levels": [2, 0]},  # a level without a task
    ],
    ids=repr,
)
def test_a_segment_whose_task_attributes_do_not_check_out_is_corrupt(attrs):
    objects = encode_segment(
        [_scored(0, [1, 0], "leg_counting", 0), _scored(1, [0, 1], "chain_sum", 0)]
    )
    with pytest.raises(CorruptSegmentError, match="segment is inconsistent"):
        decode_segment(_with_attrs(objects, **attrs))


# --- rollout sums ------------------------------------------------------------------------------


def test_rollout_sums_count_each_tasks_responses_and_correct_ones():
    groups = [
        _scored(0, [1, 0, 1, 0], "leg_counting", 0),
        _scored(1, [1, 1, 1, 0], "leg_counting", 0),
        _scored(2, [0.5, 0.99, 1.0, 0], "chain_sum"),  # partial credit is not correct
        _scored(3, [1, 1, 1, 1]),  # no task: in the totals only
    ]
    sums = RolloutSums.of(groups)
    assert sums.task_responses == {"leg_counting": 8, "chain_sum": 4}
    assert sums.task_correct == {"leg_counting": 5, "chain_sum": 1}
    metrics = sums.metrics("rollout")
    assert metrics["task/leg_counting/acc"] == pytest.approx(5 / 8)
    assert metrics["task/chain_sum/acc"] == pytest.approx(1 / 4)
    assert [k for k in metrics if k.startswith("task")] == [
        "task/chain_sum/acc", "task/leg_counting/acc",
    ]  # fmt: skip
    accepted = sums.metrics("rollout_accepted")
    assert accepted["task_accepted/leg_counting/acc"] == pytest.approx(5 / 8)
    assert not [k for k in accepted if k.startswith("task/")]
    assert not [k for k in RolloutSums.of(groups[3:]).metrics("rollout") if "task" in k]

    merged = RolloutSums.of(groups[:1])
    merged.merge(RolloutSums.of(groups[1:]))
    assert (merged.task_responses, merged.task_correct) == (sums.task_responses, sums.task_correct)


def test_past_max_tasks_the_rest_are_counted_as_other():
    groups = [_scored(i, [1, 0], f"task{i}") for i in range(MAX_TASKS + 5)]
    sums = RolloutSums.of(groups)
    assert len(sums.task_responses) == MAX_TASKS + 1
    assert sums.task_responses[OTHER_TASKS] == 2 * 5
    assert sums.task_correct[OTHER_TASKS] == 5
    assert sum(sums.task_responses.values()) == sums.responses
    sums.add(_scored(0, [1, 1], "task0"))  # a task counted apart stays apart
    assert (sums.task_responses["task0"], sums.task_correct["task0"]) == (4, 3)
    # merging: a full sum's new tasks go to other too
    merged = RolloutSums.of(groups[:MAX_TASKS])
    merged.merge(RolloutSums.of([_scored(99, [1, 1, 0], "late")]))
    assert "late" not in merged.task_responses
    assert (merged.task_responses[OTHER_TASKS], merged.task_correct[OTHER_TASKS]) == (3, 2)
    assert len([k for k in sums.metrics("rollout") if k.startswith("task/")]) == MAX_TASKS + 1


def _record(sums: RolloutSums) -> CommitRecord:
    return CommitRecord(
        seq=0, segment="gen0-abc-000000", writer_id="gen0", incarnation="abc", num_groups=2,
        num_responses=sums.responses, num_tokens=10, min_policy_version=0, max_policy_version=0,
        objects={"zarr.json": (10, 1)}, rollout=sums,
    )  # fmt: skip


def test_task_counts_ride_on_a_commit_record_and_old_records_read_without_them():
    sums = RolloutSums.of([_scored(0, [1, 0], "leg_counting", 0), _scored(1, [1, 1], "a.b-c")])
    record = _record(sums)
    assert CommitRecord.from_json(record.to_json(), 0).rollout == sums
    stored = json.loads(record.to_json())
    old_rollout = {k: v for k, v in stored["rollout"].items()
                   if k not in ("task_responses", "task_correct")}  # fmt: skip
    old = CommitRecord.from_json(json.dumps({**stored, "rollout": old_rollout}).encode(), 0)
    assert (old.rollout.task_responses, old.rollout.task_correct) == ({}, {})
    assert RolloutSums.from_dict(old_rollout).responses == sums.responses
    assert not [k for k in old.rollout.metrics("rollout") if k.startswith("task/")]


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("task_responses", ["leg_counting"], r"rollout.task_responses must map task names"),
        ("task_responses", {"a/b": 2}, r"rollout.task_responses must map task names"),
        ("task_responses", {"": 2}, r"rollout.task_responses must map task names"),
        (
            "task_correct",
            {"leg_counting": -1},
            r"rollout.task_correct\['leg_counting'\] must be "
            "an integer ≥ 0",
        ),
        ("task_correct", {"leg_counting": 1.5}, r"task_correct\['leg_counting'\] must be an int"),
        ("task_responses", {"leg_counting": True}, r"task_responses\['leg_counting'\] must be an"),
        ("task_responses", {"leg_counting": "2"}, r"task_responses\['leg_counting'\] must be an"),
        ("task_correct", {"leg_counting": 3}, "rollout.task_correct exceeds task_responses"),
        ("task_correct", None, r"rollout.task_correct must map task names"),
    ],
)
def test_a_commit_record_with_bad_task_counts_is_refused(field, value, match):
    sums = RolloutSums.of([_scored(0, [1, 0], "leg_counting", 0)])
    stored = json.loads(_record(sums).to_json())
    rollout = {**stored["rollout"], field: value}
    with pytest.raises(InvalidRecordError, match=match):
        CommitRecord.from_json(json.dumps({**stored, "rollout": rollout}).encode(), 0)
