"""Commit records: reward-failure counts carried by the next commit of the writer that counted
them, counted once, and read as 0 from records written before the fields existed; the naming
rule that keeps every path a record names under `stream/segments/`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from storage.fs import open_location
from storage.stream.records import CommitRecord, InvalidRecordError, segment_name
from storage.stream.writer import StreamWriter, read_log
from tests.stream_data import random_group


def _groups(n: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [random_group(rng, prompt_id=f"p{i}") for i in range(n)]


def test_failures_ride_on_the_next_commit_of_their_writer_only(tmp_path):
    run = open_location(str(tmp_path / "run"))
    counted, other = StreamWriter(run, "gen0"), StreamWriter(run, "gen1")
    counted.count_reward_failures(errors=2, timeouts=1, dropped_groups=1)
    counted.count_reward_failures(errors=1, dropped_groups=1)
    other.write(_groups(1))
    counted.write(_groups(2))
    counted.write(_groups(1))  # nothing new counted since the previous commit
    counted.count_reward_failures(timeouts=4)
    for group in _groups(3, seed=1):
        counted.append(group)
    counted.flush()

    failures = [
        (r.writer_id, r.reward_errors, r.reward_timeouts, r.reward_dropped_groups)
        for r in read_log(run)
    ]
    assert failures == [("gen1", 0, 0, 0), ("gen0", 3, 1, 2), ("gen0", 0, 0, 0), ("gen0", 0, 4, 0)]


def test_judge_verdicts_ride_on_the_next_commit_and_are_checked(tmp_path):
    run = open_location(str(tmp_path / "run"))
    writer = StreamWriter(run, "gen0")
    writer.count_judge_verdicts(5, 2)
    writer.count_judge_verdicts(3, 0)
    writer.write(_groups(2))
    writer.write(_groups(1))
    counted = [(r.judge_verdicts, r.judge_unparsed) for r in read_log(run)]
    assert counted == [(8, 2), (0, 0)]
    stored = json.loads(next(iter(read_log(run))).to_json())
    with pytest.raises(InvalidRecordError, match="judge_unparsed exceeds judge_verdicts"):
        CommitRecord.from_json(json.dumps({**stored, "judge_unparsed": 9}).encode(), 0)


def test_a_record_without_the_failure_fields_reads_as_zero_failures():
    old = {  # as written before the reward-failure fields existed
        "seq": 7,
        "segment": "gen0-abc-000001",
        "writer_id": "gen0",
        "incarnation": "abc",
        "num_groups": 4,
        "num_responses": 16,
        "num_tokens": 100,
        "min_policy_version": 0,
        "max_policy_version": 1,
        "objects": {"zarr.json": [10, 123]},
        "committed_at": 1.5,
    }
    record = CommitRecord.from_json(json.dumps(old).encode(), 7)
    assert (record.reward_errors, record.reward_timeouts, record.reward_dropped_groups) == (0, 0, 0)
    assert CommitRecord.from_json(record.to_json(), 7) == record


def _record(**changes) -> bytes:
    body = {
        "seq": 3,
        "segment": "gen0-18f3a2b4c5d-000002",
        "writer_id": "gen0",
        "incarnation": "18f3a2b4c5d",
        "num_groups": 1,
        "num_responses": 4,
        "num_tokens": 40,
        "min_policy_version": 0,
        "max_policy_version": 0,
        "objects": {"zarr.json": [10, 123], "rewards/c/0": [16, 7]},
        "committed_at": 1.5,
    }
    return json.dumps({**body, **changes}).encode()


def test_a_record_as_writers_write_it_is_valid():
    record = CommitRecord.from_json(_record(), 3)
    assert record.segment == segment_name("gen0", "18f3a2b4c5d", 2)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("segment", "/some/dir"),
        ("segment", "../x"),
        ("segment", "../../checkpoints/step-00000001"),
        ("segment", "other/gen0-18f3a2b4c5d-000002"),
        ("segment", "gen0-18f3a2b4c5d-000002/.."),
        ("segment", "gen1-18f3a2b4c5d-000002"),  # not the writer's own name
        ("segment", "gen0-ffff-000002"),  # nor its incarnation's
        ("segment", ""),
        ("objects", {"../../../victim/keep.txt": [10, 1]}),
        ("objects", {"/etc/passwd": [10, 1]}),
        ("objects", {"rewards/../../x": [10, 1]}),
        ("objects", {}),
        ("objects", {"zarr.json": [-1, 1]}),
        ("num_groups", -2),
        ("max_policy_version", -1),
    ],
)
def test_a_record_breaking_the_naming_rule_is_invalid_naming_the_field(field, value):
    with pytest.raises(InvalidRecordError, match=f"commit record 3.*{field}"):
        CommitRecord.from_json(_record(**{field: value}), 3)


def test_an_invalid_stored_record_reads_as_a_rejected_placeholder_naming_no_path():
    rejected = CommitRecord.rejected_record(3, "segment '/some/dir' is not a segment name")
    assert rejected.rejected
    assert rejected.segment == ""
    assert rejected.objects == {}
    assert (rejected.num_groups, rejected.num_responses, rejected.num_tokens) == (0, 0, 0)


def test_status_shows_the_judges_unparsed_share(tmp_path):
    from storage.control.manifest import create_run
    from streamrl.config.loading import load_config
    from streamrl.runs.status import read_status
    from streamrl.runs.status_format import format_status

    run = open_location(str(tmp_path / "run"))
    create_run(run, load_config(["grpo", "tiny-cpu"]).model_dump(mode="json"))
    writer = StreamWriter(run, "gen0")
    writer.count_judge_verdicts(8, 2)
    writer.write(_groups(2))
    status = read_status(run)
    assert (status.stream.judge_verdicts, status.stream.judge_unparsed) == (8, 2)
    assert "judges: 2 of 8 verdicts unparsed (judge/unparsed_frac 0.250" in format_status(status)
