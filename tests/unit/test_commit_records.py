"""Reward-failure counts on commit records: carried by the next commit of the writer that
counted them, counted once, and read as 0 from records written before the fields existed."""

from __future__ import annotations

import json

import numpy as np

from storage.fs import open_location
from storage.records import CommitRecord
from storage.stream import StreamWriter, read_log
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
