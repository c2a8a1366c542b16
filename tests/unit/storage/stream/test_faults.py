"""Replay-stream fault handling on a local folder: a failing read is retried, never mistaken for
corruption; the commit deadline and the sweeper's minimum grace; empty orphan folders.

Storage faults come from `FaultyFS`, the local filesystem with failures injected at its read
and write calls (the SeaweedFS versions of these are in
tests/integration/storage/stream/test_faults.py).
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import numpy as np
import pytest
from fsspec.implementations.local import LocalFileSystem

from storage.fs import Location, open_location
from storage.stream.records import Cursor
from storage.stream.writer import (
    StorageUnavailableError,
    StreamReader,
    StreamTimeoutError,
    StreamWriter,
    SweepGraceError,
    min_sweep_grace_s,
    orphan_segments,
    quarantined,
    read_log,
    sweep_orphans,
)
from tests.stream_data import random_group


class FaultyFS(LocalFileSystem):
    """The local filesystem, but every `fail_every`-th read of a path containing `where`
    raises `read_error` (as an S3 5xx or a dropped connection does) until `read_failures` have
    failed, and the next `slow_writes` `pipe` calls take `write_delay_s` longer."""

    cachable = False  # every instance keeps its own fault counters

    def __init__(self) -> None:
        super().__init__()
        self.read_failures, self.where, self.fail_every = 0, "/stream/", 1
        self.read_error: type[OSError] = OSError
        self.reads = self.failed_reads = 0
        self.slow_writes, self.write_delay_s = 0, 0.0

    def cat_file(self, path, start=None, end=None, **kwargs):
        self.reads += self.where in path
        if self.read_failures > 0 and self.where in path and self.reads % self.fail_every == 0:
            self.read_failures -= 1
            self.failed_reads += 1
            if self.read_error is FileNotFoundError:
                raise FileNotFoundError(errno.ENOENT, "injected: no such object", path)
            raise self.read_error(errno.EIO, "injected: 503 Slow Down", path)
        return super().cat_file(path, start=start, end=end, **kwargs)

    def pipe(self, path, value=None, **kwargs):
        if self.slow_writes > 0:
            self.slow_writes -= 1
            time.sleep(self.write_delay_s)
        return super().pipe(path, value, **kwargs)


def _faulty(tmp_path: Path) -> Location:
    path = str(tmp_path / "run")
    return Location(FaultyFS(), path, path)


def _groups(n: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [random_group(rng, prompt_id=f"s{seed}/{i}") for i in range(n)]


def _ids(groups) -> list[str]:
    return [g.prompt_id for g in groups]


def _read(reader: StreamReader, n: int, timeout_s: float = 30.0) -> list:
    it = reader.groups(timeout_s=timeout_s)
    return [next(it) for _ in range(n)]


def _corrupt_one_object(run: Location, segment: str) -> None:
    chunk = run.join("stream", "segments", segment, "response_tokens", "c", "0")
    data = bytearray(run.fs.cat_file(chunk))
    data[3] ^= 0x01
    run.fs.pipe_file(chunk, bytes(data))


@pytest.mark.parametrize("prefetch_rounds", [0, 2])
def test_failing_reads_are_retried_in_order_and_only_a_bad_crc_is_quarantined(
    tmp_path, prefetch_rounds
):
    run = _faulty(tmp_path)
    writer = StreamWriter(run, "gen0", compression="none")
    segments = [_groups(3, seed) for seed in range(4)]
    records = [writer.write(groups) for groups in segments]
    _corrupt_one_object(run, records[2].segment)

    run.fs.read_failures, run.fs.fail_every = 40, 3  # log and segment reads fail for a while
    reader = StreamReader(
        run, records_per_round=2, prefetch_rounds=prefetch_rounds, max_retry_wait_s=0.05
    )
    got = _read(reader, 9)

    assert _ids(got) == _ids(segments[0] + segments[1] + segments[3])
    assert run.fs.failed_reads == 40
    assert reader.stats.transient_errors >= 1
    assert reader.stats.quarantined == [2]  # the corrupt segment, and only it
    assert reader.stats.num_quarantined == 1
    assert quarantined(run) == [2]
    assert reader.cursor == Cursor(4, 0)


def test_a_failed_read_mid_round_delivers_the_segments_before_it(tmp_path):
    run = _faulty(tmp_path)
    writer = StreamWriter(run, "gen0")
    first, second = _groups(2, 0), _groups(2, 1)
    writer.write(first)
    second_record = writer.write(second)
    reader = StreamReader(run)
    run.fs.read_failures, run.fs.where = 1, f"/{second_record.segment}/"
    assert _ids(g for _, g in reader.poll()) == _ids(first)  # then the failure ends the round
    assert reader.stats.transient_errors == 1
    assert _ids(g for _, g in reader.poll(Cursor(1))) == _ids(second)
    assert reader.stats.quarantined == []


def test_an_object_missing_only_briefly_is_read(tmp_path):
    run = _faulty(tmp_path)
    groups = _groups(3, 0)
    StreamWriter(run, "gen0").write(groups)
    run.fs.read_failures, run.fs.where = 3, "/segments/"
    run.fs.read_error = FileNotFoundError
    reader = StreamReader(run, max_retry_wait_s=0.05, missing_grace_s=30)
    assert _ids(_read(reader, 3)) == _ids(groups)
    assert reader.stats.quarantined == []
    assert reader.stats.transient_errors >= 1


def test_an_object_that_stays_missing_is_quarantined_after_the_grace(tmp_path):
    run = open_location(str(tmp_path / "run"))
    writer = StreamWriter(run, "gen0")
    before, lost, after = _groups(2, 0), _groups(2, 1), _groups(2, 2)
    writer.write(before)
    lost_record = writer.write(lost)
    writer.write(after)
    run.fs.rm_file(run.join("stream", "segments", lost_record.segment, "zarr.json"))

    reader = StreamReader(run, max_retry_wait_s=0.05, missing_grace_s=0.5)
    started = time.monotonic()
    assert _ids(_read(reader, 4)) == _ids(before + after)
    assert time.monotonic() - started >= 0.5  # retried for the whole grace first
    assert reader.stats.quarantined == [1]
    assert reader.stats.transient_errors >= 2


def test_timeout_during_an_outage_names_the_error_and_keeps_the_cursor(tmp_path):
    run = _faulty(tmp_path)
    writer = StreamWriter(run, "gen0")
    first = _groups(2, 0)
    writer.write(first)
    writer.write(_groups(2, 1))
    reader = StreamReader(run, records_per_round=1, prefetch_rounds=0, max_retry_wait_s=0.05)
    it = reader.groups(timeout_s=0.5)
    assert _ids([next(it), next(it)]) == _ids(first)
    run.fs.read_failures = 10**6  # the store is down from here on
    with pytest.raises(StreamTimeoutError, match=r"last storage read failed: .*503 Slow Down"):
        next(it)
    assert reader.cursor == Cursor(1, 0)  # resuming here loses nothing
    assert reader.stats.quarantined == []
    assert quarantined(run) == []


def test_a_failed_log_read_raises_instead_of_shortening_the_log(tmp_path):
    """Else a sweeper would take the segments of unread records for orphans."""
    run = _faulty(tmp_path)
    StreamWriter(run, "gen0").write(_groups(1, 0))
    run.fs.read_failures, run.fs.where = 1, "/log/"
    with pytest.raises(StorageUnavailableError, match="commit record 0"):
        list(read_log(run))
    run.fs.read_failures = 1
    with pytest.raises(StorageUnavailableError):
        orphan_segments(run, min_sweep_grace_s(), now=time.time() + 86400)


def test_writer_past_its_commit_deadline_commits_a_fresh_copy_never_the_stale_name(tmp_path):
    run = _faulty(tmp_path)
    writer = StreamWriter(run, "gen0", commit_deadline_s=0.3)
    run.fs.slow_writes, run.fs.write_delay_s = 1, 0.4  # the first upload outlives the deadline
    groups = _groups(3, 0)
    record = writer.write(groups)

    stale = f"gen0-{writer.incarnation}-000000"
    assert record.segment == f"gen0-{writer.incarnation}-000001"
    assert writer.stats.reuploads == 1
    assert [r.segment for r in read_log(run)] == [record.segment]
    assert _ids(_read(StreamReader(run), 3)) == _ids(groups)
    # The stale copy is an orphan, removable once the sweeper's (short) grace has passed.
    removed = sweep_orphans(run, 0.5, commit_deadline_s=0.3, margin_s=0.2, now=time.time() + 1)
    assert removed == [stale]
    assert _ids(_read(StreamReader(run), 3)) == _ids(groups)


def test_writer_gives_up_when_every_upload_outlives_the_deadline(tmp_path):
    run = _faulty(tmp_path)
    writer = StreamWriter(run, "gen0", commit_deadline_s=0.2)
    run.fs.slow_writes, run.fs.write_delay_s = 4, 0.3  # the first upload and 3 more
    with pytest.raises(RuntimeError, match=r"uploaded 4 times .* raise commit_deadline_s"):
        writer.write(_groups(1, 0))
    assert writer.stats.reuploads == 3
    assert list(read_log(run)) == []


def test_sweep_refuses_a_grace_shorter_than_the_deadline_plus_margin(tmp_path):
    run = open_location(str(tmp_path / "run"))
    assert min_sweep_grace_s() == 600.0
    with pytest.raises(SweepGraceError, match="use a grace of at least 600s"):
        sweep_orphans(run, 599)
    with pytest.raises(SweepGraceError, match="at least 3s"):
        orphan_segments(run, 2.5, commit_deadline_s=2, margin_s=1)
    assert orphan_segments(run, 3, commit_deadline_s=2, margin_s=1) == []


def test_sweeper_removes_old_empty_folders_of_writers_killed_before_their_first_object(tmp_path):
    run = open_location(str(tmp_path / "run"))
    committed = StreamWriter(run, "gen0").write(_groups(1, 0))
    segments = tmp_path / "run" / "stream" / "segments"
    old, young = segments / "gen9-dead-000000", segments / "gen8-live-000000"
    for folder in (old, young):  # what `_put_objects` makes before it writes any object
        (folder / "response_tokens" / "c").mkdir(parents=True)
    an_hour_ago = time.time() - 3600
    for path in (old / "response_tokens" / "c", old / "response_tokens", old):
        os.utime(path, (an_hour_ago, an_hour_ago))

    assert orphan_segments(run, 600) == [old.name]
    assert sweep_orphans(run, 600) == [old.name]
    assert sorted(p.name for p in segments.iterdir()) == sorted([committed.segment, young.name])
