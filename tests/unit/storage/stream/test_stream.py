"""Replay stream in one process, on a local folder and on SeaweedFS: records, segments, the
commit log, the reader's cursor, quarantine and the sweeper."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from storage.fs import Location, open_location, put_if_absent
from storage.stream.records import CommitRecord, Cursor, InvalidRecordError
from storage.stream.segments import CorruptSegmentError, decode_segment, encode_segment
from storage.stream.writer import (
    StreamReader,
    StreamTimeoutError,
    StreamWriter,
    quarantined,
    read_log,
    sweep_orphans,
)
from tests.stream_data import random_group


def _groups(n: int, seed: int = 0, writer: str = "gen0", **kwargs) -> list:
    rng = np.random.default_rng(seed)
    return [
        random_group(rng, prompt_id=f"{writer}/{i}", generator_id=writer, **kwargs)
        for i in range(n)
    ]


@pytest.mark.parametrize("compression", ["zstd", "blosc", "none"])
def test_segment_round_trip_is_exact(compression):
    groups = _groups(5, group_size=3, min_len=0, max_len=9)
    decoded = decode_segment(encode_segment(groups, compression))
    assert len(decoded) == 5
    assert all(a.equals(b) for a, b in zip(groups, decoded, strict=True))
    assert decoded[0].response_tokens[0].dtype == np.int32
    assert decoded[0].behaviour_logprobs[0].dtype == np.float32


def test_segment_flipped_byte_is_detected():
    objects = encode_segment(_groups(3), "none")
    key = "behaviour_logprobs/c/0"
    data = bytearray(objects[key])
    data[len(data) // 2] ^= 0xFF
    with pytest.raises(CorruptSegmentError, match="behaviour_logprobs"):
        decode_segment({**objects, key: bytes(data)})


def test_invalid_group_rejected_on_write_naming_the_field():
    group = _groups(1)[0]
    bad = type(group)(
        **{**group.__dict__, "behaviour_logprobs": [lp[:-1] for lp in group.behaviour_logprobs]}
    )
    with pytest.raises(InvalidRecordError, match="same length"):
        encode_segment([bad])
    writer_group = type(group)(**{**group.__dict__, "rewards": group.rewards[:1]})
    with pytest.raises(InvalidRecordError, match="rewards has 1 entries but there are 4"):
        writer_group.validate()


def test_writer_and_reader_round_trip(run_location: Location):
    writer = StreamWriter(run_location, "gen0")
    groups = _groups(7)
    for group in groups[:4]:
        writer.append(group)
    first = writer.flush()
    assert writer.flush() is None  # nothing buffered
    second = writer.write(groups[4:])
    assert (first.seq, second.seq) == (0, 1)
    assert first.num_groups == 4
    assert second.num_groups == 3

    reader = StreamReader(run_location)
    got = list(_take(reader, 7))
    assert all(a.equals(b) for a, b in zip(groups, got, strict=True))
    assert reader.cursor == Cursor(2, 0)
    assert [r.segment for r in read_log(run_location)] == [first.segment, second.segment]


def _take(reader: StreamReader, n: int, timeout_s: float = 10.0):
    iterator = reader.groups(timeout_s=timeout_s)
    for _ in range(n):
        yield next(iterator)


@pytest.mark.parametrize("prefetch_rounds", [0, 2])
def test_reader_resumes_mid_segment_from_a_saved_cursor(run_location: Location, prefetch_rounds):
    writer = StreamWriter(run_location, "gen0")
    groups = _groups(6)
    writer.write(groups[:4])
    writer.write(groups[4:])
    reader = StreamReader(run_location, records_per_round=1, prefetch_rounds=prefetch_rounds)
    list(_take(reader, 3))
    saved = reader.cursor
    assert saved == Cursor(0, 3)
    resumed = StreamReader(run_location, Cursor.from_dict(json.loads(json.dumps(saved.to_dict()))))
    rest = list(_take(resumed, 3))
    assert [g.prompt_id for g in rest] == [g.prompt_id for g in groups[3:]]


def test_reader_times_out_on_an_idle_stream(run_location: Location):
    reader = StreamReader(run_location, max_poll_s=0.05)
    with pytest.raises(StreamTimeoutError, match="no new group"):
        next(reader.groups(timeout_s=0.3))


def test_two_writers_interleave_without_gaps(run_location: Location):
    a, b = StreamWriter(run_location, "a"), StreamWriter(run_location, "b")
    for i in range(3):
        a.write(_groups(1, seed=i, writer="a"))
        b.write(_groups(1, seed=i, writer="b"))
    seqs = [r.seq for r in read_log(run_location)]
    assert seqs == list(range(6))
    # b always started from a stale hint and had to jump forward past a's records
    assert b.stats.commit_conflicts >= 1


def test_commit_recognises_its_own_record_after_a_retried_request(run_location: Location):
    """A retried PUT whose first attempt landed finds its own record and does not commit twice."""
    writer = StreamWriter(run_location, "gen0")
    uploaded = writer.upload(_groups(2))
    stream = run_location.child("stream")
    # Simulate the first attempt having landed while its response was lost.
    landed = CommitRecord(**{**uploaded.record.__dict__, "seq": 0, "committed_at": 1.0})
    assert put_if_absent(stream.fs, stream.join("log", f"{0:012d}.json"), landed.to_json())
    record = writer.commit(uploaded)
    assert record.seq == 0
    assert record.committed_at == 1.0
    assert len(list(read_log(run_location))) == 1
    assert writer.stats.commit_conflicts == 0


def test_corrupt_committed_segment_is_quarantined_and_reader_goes_on(run_location: Location):
    writer = StreamWriter(run_location, "gen0", compression="none")
    good_before, bad, good_after = _groups(2, 1), _groups(2, 2), _groups(2, 3)
    writer.write(good_before)
    bad_record = writer.write(bad)
    writer.write(good_after)
    fs = run_location.fs
    chunk = run_location.join("stream", "segments", bad_record.segment, "response_tokens", "c", "0")
    data = bytearray(fs.cat_file(chunk))
    data[3] ^= 0x01
    fs.pipe_file(chunk, bytes(data))

    reader = StreamReader(run_location)
    got = list(_take(reader, 4))
    assert [g.prompt_id for g in got] == [g.prompt_id for g in good_before + good_after]
    assert reader.stats.quarantined == [1]
    assert quarantined(run_location) == [1]
    note = json.loads(fs.cat_file(run_location.join("stream", "quarantine", f"{1:012d}.json")))
    assert note["segment"] == bad_record.segment
    assert "CRC32" in note["error"]
    assert reader.cursor == Cursor(3, 0)


def test_sweeper_removes_only_old_uncommitted_segments(run_location: Location):
    writer = StreamWriter(run_location, "gen0")
    committed = writer.write(_groups(1))
    orphan = writer.upload(_groups(1, seed=5))  # uploaded, never committed
    assert sweep_orphans(run_location, grace_s=3600) == []  # too young
    removed = sweep_orphans(run_location, grace_s=3600, now=time.time() + 7200)
    assert removed == [orphan.record.segment]
    assert sweep_orphans(run_location, grace_s=3600, now=time.time() + 7200) == []
    stored = run_location.fs.find(run_location.join("stream", "segments"))
    assert stored
    assert {p.split("/segments/")[1].split("/")[0] for p in stored} == {committed.segment}
    assert len(list(_take(StreamReader(run_location), 1))) == 1


def test_bad_writer_id_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="writer id"):
        StreamWriter(open_location(str(tmp_path)), "gen-0/x")
