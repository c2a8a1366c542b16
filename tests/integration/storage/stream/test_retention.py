"""Stream retention with real checkpoints: segments are released only up to the oldest stored
checkpoint's cursor, so resuming from any of them reads exactly what it read before; a learner
with `storage.stream_retention=consumed` releases them after each checkpoint and resumes, one
with `keep` releases nothing."""

from __future__ import annotations

import logging
from itertools import islice

import numpy as np
import pytest
import torch
from torch import nn

from storage.checkpoints.dcp import CheckpointStore, LearnerState, ModelState
from storage.fs import Location, open_location
from storage.stream.records import CommitRecord, Cursor
from storage.stream.retention import (
    ReleasedStreamError,
    StreamRetention,
    oldest_resume_cursor,
    read_retention,
    release_consumed,
)
from storage.stream.writer import StreamReader, StreamWriter, read_log
from streamrl.config.loading import load_config
from streamrl.learner.loop import Learner
from streamrl.learner.topology import Topology
from tests.stream_data import random_group


@pytest.fixture(scope="module")
def topology():
    topo = Topology.from_env("cpu")
    yield topo
    topo.destroy()


def _write_segments(run: Location, count: int, groups_per_segment: int) -> list[CommitRecord]:
    rng = np.random.default_rng(0)
    writer = StreamWriter(run, "gen0")
    return [
        writer.write(
            [
                random_group(rng, prompt_id=f"s{s}/{g}", vocab=600, max_len=24, prompt_len=10)
                for g in range(groups_per_segment)
            ]
        )
        for s in range(count)
    ]


def _stored_segments(run: Location) -> set[str]:
    stored = run.fs.find(run.join("stream", "segments"))
    return {p.split("/segments/")[1].split("/")[0] for p in stored}


def _read_to_end(run: Location, cursor: Cursor, records: list[CommitRecord]) -> list:
    n = sum(r.num_groups for r in records[cursor.seq :]) - cursor.offset
    return list(islice(StreamReader(run, cursor, prefetch_rounds=0).groups(timeout_s=10), n))


def _checkpoint(store: CheckpointStore, step: int, cursor: Cursor) -> None:
    torch.manual_seed(step)
    model = nn.Linear(4, 2)
    state = LearnerState(step=step, policy_version=step, stream_cursor=cursor.to_dict())
    store.save({"policy": ModelState(model)}, state)


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.equals(y) for x, y in zip(a, b, strict=True))


def test_only_segments_before_the_oldest_checkpoint_are_released(run_location: Location):
    records = _write_segments(run_location, 6, groups_per_segment=3)
    names = [r.segment for r in records]
    store = CheckpointStore(run_location)
    older, newer = Cursor(2, 1), Cursor(4, 0)
    _checkpoint(store, 1, older)
    _checkpoint(store, 2, newer)
    from_older = _read_to_end(run_location, older, records)
    from_newer = _read_to_end(run_location, newer, records)

    assert oldest_resume_cursor(store) == older
    assert release_consumed(run_location, oldest_resume_cursor(store)) == names[:2]
    assert _stored_segments(run_location) == set(names[2:])  # segment 2: step 1 is inside it
    assert list(read_log(run_location)) == records
    assert _same(_read_to_end(run_location, older, records), from_older)
    assert _same(_read_to_end(run_location, newer, records), from_newer)

    store.retain(1)  # step 1 is gone: step 2's cursor is now the oldest a resume can need
    assert release_consumed(run_location, oldest_resume_cursor(store)) == names[2:4]
    assert _stored_segments(run_location) == set(names[4:])
    assert read_retention(run_location) == StreamRetention(4, 4)
    assert _same(_read_to_end(run_location, newer, records), from_newer)
    with pytest.raises(ReleasedStreamError, match="cursor 2:1"):
        _read_to_end(run_location, older, records)


def _config(run_dir, total_steps: int, retention: str):
    return load_config(
        ["dapo", "tiny-cpu"],
        overrides=[
            f"storage.run_uri={run_dir}",
            f"storage.stream_retention={retention}",
            f"learner.total_steps={total_steps}",
            "learner.batch_groups=4",
            "learner.mini_batch_groups=4",
            "learner.checkpoint_every=1",
            "learner.keep_checkpoints=2",
            "learner.max_staleness=100",  # the pre-written stream is all version 0
            "generator.max_tokens=24",
        ],
    )


def test_a_learner_releasing_consumed_segments_keeps_what_its_checkpoints_resume_from(
    tmp_path, topology, caplog
):
    run_dir = tmp_path / "run"
    run = open_location(str(run_dir))
    records = _write_segments(run, 20, groups_per_segment=2)
    with caplog.at_level(logging.INFO, logger="streamrl.learner.checkpointing"):
        Learner(_config(run_dir, 3, "consumed"), run, topology).run()

    store = CheckpointStore(run)
    assert store.committed_steps() == [2, 3]
    oldest = min(Cursor.from_dict(store.read_state(s).stream_cursor) for s in [2, 3])
    assert oldest.seq >= 2  # something was consumed before the older checkpoint
    assert _stored_segments(run) == {r.segment for r in records[oldest.seq :]}
    assert list(read_log(run)) == records
    assert read_retention(run).released_before_seq == oldest.seq
    assert "consumed stream segments" in caplog.text

    resumed = Learner(_config(run_dir, 4, "consumed"), run, topology)
    assert resumed.state.step == 3
    assert resumed.run() == 4  # reads on from step 3's cursor, all of it still stored


def test_a_learner_keeping_the_stream_deletes_nothing(tmp_path, topology):
    run_dir = tmp_path / "run"
    run = open_location(str(run_dir))
    records = _write_segments(run, 20, groups_per_segment=2)
    Learner(_config(run_dir, 3, "keep"), run, topology).run()

    assert CheckpointStore(run).committed_steps() == [2, 3]
    assert _stored_segments(run) == {r.segment for r in records}
    assert read_retention(run) == StreamRetention()
    assert not (run_dir / "stream" / "retention.json").exists()
