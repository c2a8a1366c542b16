"""Paths named by commit records, on a local folder and on SeaweedFS: a record whose segment or
object names break the writers' naming rule (an absolute path, `..`, another prefix of the run)
is quarantined — counted, logged, noted under `quarantine/` — and never read or deleted, by the
reader, by stream retention (`storage.stream_retention=consumed`) or by the sweeper."""

from __future__ import annotations

import json
import logging
import posixpath
import time
import uuid
from itertools import islice
from pathlib import Path

import numpy as np
import pytest

from storage.fs import Location, put_if_absent
from storage.stream.log import log_path
from storage.stream.records import CommitRecord, Cursor
from storage.stream.retention import read_retention, release_consumed
from storage.stream.writer import (
    StreamReader,
    StreamWriter,
    min_sweep_grace_s,
    orphan_segments,
    quarantined,
    read_log,
)
from tests.stream_data import RecordingFS, random_group

GROUPS_PER_SEGMENT = 3


def _write(writer: StreamWriter, seed: int) -> CommitRecord:
    rng = np.random.default_rng(seed)
    return writer.write([random_group(rng, prompt_id=f"s{seed}/{g}") for g in range(3)])


def _forge(run: Location, seq: int, template: CommitRecord, **changes) -> None:
    """Store a commit record at `seq`: `template` with `changes`, as anyone able to write the
    run's storage could."""
    body = json.loads(template.to_json())
    body.update(seq=seq, **changes)
    assert put_if_absent(run.fs, log_path(run.child("stream"), seq), json.dumps(body).encode())


def _plant(run: Location, path: str) -> str:
    """An object at `path` (a folder a forged record points at); returns the folder."""
    if run.is_local:
        run.fs.makedirs(path, exist_ok=True)
    run.fs.pipe_file(posixpath.join(path, "keep.txt"), b"must survive")
    return path


def _read(run: Location, n: int) -> tuple[list, StreamReader]:
    reader = StreamReader(run, prefetch_rounds=0, missing_grace_s=0.0)
    return list(islice(reader.groups(timeout_s=10), n)), reader


def test_records_naming_paths_outside_the_segments_are_quarantined_never_deleted(
    run_location: Location, caplog: pytest.LogCaptureFixture
):
    run = run_location
    writer = StreamWriter(run, "gen0")
    first = _write(writer, 0)
    outside = _plant(run, f"{posixpath.dirname(run.path)}/victim-{uuid.uuid4().hex[:8]}")
    stream_sibling = _plant(run, run.join("stream", "x"))
    other_prefix = _plant(run, run.join("checkpoints", "step-00000001"))
    _forge(run, 1, first, segment="/" + outside.lstrip("/"))  # an absolute path: /some/dir
    _forge(run, 2, first, segment="../x")
    _forge(run, 3, first, segment="../../checkpoints/step-00000001")
    last = _write(writer, 1)  # claims log number 4, after the forged ones
    assert last.seq == 4

    with caplog.at_level(logging.ERROR, logger="storage.stream.reader"):
        groups, reader = _read(run, 2 * GROUPS_PER_SEGMENT)
    assert [g.prompt_id for g in groups] == [f"s{s}/{g}" for s in (0, 1) for g in range(3)]
    assert reader.stats.quarantined == [1, 2, 3]
    assert quarantined(run) == [1, 2, 3]
    assert sum("quarantined" in r.message and "naming rule" in r.message for r in caplog.records)

    assert release_consumed(run, Cursor(5)) == [first.segment, last.segment]
    assert read_retention(run).deleted_before_seq == 5
    far_future = time.time() + 10 * min_sweep_grace_s()
    assert orphan_segments(run, min_sweep_grace_s(), now=far_future) == []
    for folder in (outside, stream_sibling, other_prefix):
        assert run.fs.cat_file(posixpath.join(folder, "keep.txt")) == b"must survive", folder
    assert len(list(read_log(run))) == 5  # the log itself is whole


def test_an_object_name_leaving_its_segment_is_never_read(tmp_path: Path):
    path = str(tmp_path / "run")
    recording = RecordingFS()
    run = Location(recording, path, path)
    first = _write(StreamWriter(run, "gen0"), 0)
    size, crc = next(iter(first.objects.values()))
    _forge(run, 1, first, objects={"../../../../victim/keep.txt": [size, crc]})
    recording.read_paths.clear()

    groups, reader = _read(run, GROUPS_PER_SEGMENT)

    assert len(groups) == GROUPS_PER_SEGMENT
    assert reader.stats.quarantined == [1]  # read in the same round as the segment before it
    assert not [p for p in recording.read_paths if "victim" in p]


def test_an_unreadable_record_is_quarantined_and_the_stream_goes_on(run_location: Location):
    run = run_location
    writer = StreamWriter(run, "gen0")
    _write(writer, 0)
    stream = run.child("stream")
    put_if_absent(run.fs, log_path(stream, 1), b"{not json")
    put_if_absent(run.fs, log_path(stream, 2), _write_elsewhere(run).to_json())  # claims seq 0
    _write(writer, 1)

    groups, reader = _read(run, 2 * GROUPS_PER_SEGMENT)

    assert len(groups) == 2 * GROUPS_PER_SEGMENT
    assert reader.stats.quarantined == [1, 2]
    records = list(read_log(run))
    assert [bool(r.rejected) for r in records] == [False, True, True, False]
    assert "claims seq 0" in records[2].rejected
    assert len(release_consumed(run, Cursor(4))) == 2


def _write_elsewhere(run: Location) -> CommitRecord:
    """A valid record of log number 0 of another run, stored nowhere."""
    other = run.child("elsewhere")
    return _write(StreamWriter(other, "gen7"), 5)
