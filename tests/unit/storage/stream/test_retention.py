"""Stream retention on a local folder and on SeaweedFS: releasing consumed segments keeps their
commit records, never releases a segment a cursor is inside, records the released point, is
idempotent and finishes a release that stopped part-way; a reader refuses to start before it;
the writer's fence is checked before anything is written or deleted."""

from __future__ import annotations

from itertools import islice

import numpy as np
import pytest
from fsspec.implementations.local import LocalFileSystem

from storage.fs import Location
from storage.stream.records import CommitRecord, Cursor
from storage.stream.retention import (
    ReleasedStreamError,
    StreamRetention,
    read_retention,
    release_consumed,
)
from storage.stream.writer import StreamReader, StreamWriter, read_log
from tests.stream_data import random_group


def _write_segments(run: Location, count: int, groups_per_segment: int = 3) -> list[CommitRecord]:
    rng = np.random.default_rng(0)
    writer = StreamWriter(run, "gen0")
    return [
        writer.write([random_group(rng, prompt_id=f"s{s}/{g}") for g in range(groups_per_segment)])
        for s in range(count)
    ]


def _stored_segments(run: Location) -> set[str]:
    """Segments holding at least one object (some S3 servers list emptied prefixes a while)."""
    stored = run.fs.find(run.join("stream", "segments"))
    return {p.split("/segments/")[1].split("/")[0] for p in stored}


def _read(run: Location, cursor: Cursor, n: int) -> list:
    return list(islice(StreamReader(run, cursor, prefetch_rounds=0).groups(timeout_s=10), n))


def test_release_deletes_only_segments_wholly_before_the_cursor(run_location: Location):
    records = _write_segments(run_location, 5)
    names = [r.segment for r in records]
    expected = _read(run_location, Cursor(2, 1), 2 + 3 * 2)

    released = release_consumed(run_location, Cursor(2, 1))  # inside segment 2: it stays

    assert released == names[:2]
    assert _stored_segments(run_location) == set(names[2:])
    assert list(read_log(run_location)) == records  # the audit trail is whole
    assert read_retention(run_location) == StreamRetention(2, 2)
    resumed = _read(run_location, Cursor(2, 1), len(expected))
    assert all(a.equals(b) for a, b in zip(expected, resumed, strict=True))


def test_a_reader_before_the_released_point_is_refused_naming_cursor_point_and_fix(
    run_location: Location,
):
    _write_segments(run_location, 4)
    release_consumed(run_location, Cursor(3))
    with pytest.raises(ReleasedStreamError) as error:
        _read(run_location, Cursor(2, 1), 1)
    message = str(error.value)
    assert "cursor 2:1" in message
    assert "below 3" in message
    assert "storage.stream_retention=consumed" in message
    assert "Resume from a committed checkpoint" in message
    assert len(_read(run_location, Cursor(3), 3)) == 3  # from the released point on: fine


def test_release_is_idempotent_and_never_moves_the_point_back(run_location: Location):
    names = [r.segment for r in _write_segments(run_location, 4)]
    assert release_consumed(run_location, Cursor(0)) == []
    assert release_consumed(run_location, Cursor(2)) == names[:2]
    assert release_consumed(run_location, Cursor(2)) == []
    assert release_consumed(run_location, Cursor(1, 2)) == []
    assert read_retention(run_location) == StreamRetention(2, 2)
    assert release_consumed(run_location, Cursor(3)) == names[2:3]
    assert _stored_segments(run_location) == {names[3]}


class _FailingRemovalFS(LocalFileSystem):
    """The local filesystem, failing the removal of the folders in `failing`."""

    cachable = False

    def __init__(self, failing: set[str]) -> None:
        super().__init__()
        self.failing = failing

    def rm(self, path, recursive=False, maxdepth=None):
        if path.rstrip("/").rsplit("/", 1)[-1] in self.failing:
            raise OSError(f"simulated storage error removing {path}")
        return super().rm(path, recursive=recursive, maxdepth=maxdepth)


def test_a_release_that_stopped_part_way_is_safe_and_finished_by_the_next(tmp_path):
    run = Location(LocalFileSystem(), str(tmp_path / "run"), str(tmp_path / "run"))
    names = [r.segment for r in _write_segments(run, 5)]
    failing = Location(_FailingRemovalFS({names[1]}), run.path, run.uri)

    with pytest.raises(OSError, match="simulated"):
        release_consumed(failing, Cursor(3))

    # Segment 0 is gone, 1 and 2 are not yet: no reader may start anywhere before 3.
    assert _stored_segments(run) == set(names[1:])
    assert read_retention(run) == StreamRetention(released_before_seq=3, deleted_before_seq=0)
    with pytest.raises(ReleasedStreamError, match="cursor 1:0"):
        _read(run, Cursor(1), 1)

    assert release_consumed(run, Cursor(3)) == names[1:3]  # segment 0, already gone, passed over
    assert read_retention(run) == StreamRetention(3, 3)
    assert _stored_segments(run) == set(names[3:])
    assert len(list(read_log(run))) == 5


def test_nothing_released_reads_as_zero_and_every_cursor_reads(tmp_path):
    run = Location(LocalFileSystem(), str(tmp_path / "run"), str(tmp_path / "run"))
    _write_segments(run, 2)
    assert read_retention(run) == StreamRetention()
    assert len(_read(run, Cursor(0), 6)) == 6


class _Fence:
    """A writer's lease as retention sees it: `check` returns the epoch held, or raises."""

    def __init__(self) -> None:
        self.lost, self.checks = False, 0

    def check(self) -> int:
        self.checks += 1
        if self.lost:
            raise RuntimeError("lease lost: epoch 2 exists")
        return 1


def test_release_checks_the_fence_before_it_deletes_anything(run_location: Location):
    names = [r.segment for r in _write_segments(run_location, 4)]
    fence = _Fence()
    fence.lost = True
    with pytest.raises(RuntimeError, match="lease lost"):
        release_consumed(run_location, Cursor(3), fence=fence)
    assert _stored_segments(run_location) == set(names)
    assert read_retention(run_location) == StreamRetention()

    fence.lost = False
    assert release_consumed(run_location, Cursor(3), fence=fence) == names[:3]
    assert fence.checks >= 2
