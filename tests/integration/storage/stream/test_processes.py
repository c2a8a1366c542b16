"""The replay stream with real writer processes, on a local folder and on SeaweedFS.

Writers run `tests/integration/storage/stream/stream_writer.py` as separate Python processes;
the reader runs in a thread of the test process at the same time.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

from storage.fs import Location
from storage.seaweedfs import SeaweedFS
from storage.stream.writer import (
    StreamReader,
    StreamTimeoutError,
    min_sweep_grace_s,
    read_log,
    sweep_orphans,
)

ROOT = Path(__file__).resolve().parents[4]


def _env(backend: str, request: pytest.FixtureRequest) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if backend == "s3":
        server: SeaweedFS = request.getfixturevalue("seaweedfs")
        env.update(server.env)
    return env


def _start_writer(uri: str, writer: str, env: dict, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integration.storage.stream.stream_writer",
            uri,
            writer,
            *args,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )


class _BackgroundReader(threading.Thread):
    """Reads groups until `expected` arrived or the stream stays idle for `idle_s`."""

    def __init__(self, run: Location, expected: int | None = None, idle_s: float = 60.0):
        super().__init__(daemon=True)
        self.reader = StreamReader(run, max_poll_s=0.2)
        self.expected, self.idle_s = expected, idle_s
        self.prompt_ids: list[str] = []
        self.stop_event = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for group in self.reader.groups(timeout_s=self.idle_s):
                self.prompt_ids.append(group.prompt_id)
                if self.expected is not None and len(self.prompt_ids) >= self.expected:
                    return
                if self.stop_event.is_set():
                    return
        except StreamTimeoutError:
            if not self.stop_event.is_set():
                raise
        except BaseException as exc:
            self.error = exc


def test_three_writers_concurrent_reader_every_group_exactly_once(
    run_uri_and_options, run_location: Location, backend: str, request
):
    uri, _ = run_uri_and_options
    env = _env(backend, request)
    per_writer, writers = 200, ["w0", "w1", "w2"]
    reader = _BackgroundReader(run_location, expected=per_writer * len(writers))
    reader.start()
    procs = [
        _start_writer(uri, w, env, "--groups", str(per_writer), "--segment", "8") for w in writers
    ]
    for proc in procs:
        proc.communicate(timeout=300)
        assert proc.returncode == 0
    reader.join(timeout=120)
    assert reader.error is None, reader.error
    assert not reader.is_alive()

    ids = reader.prompt_ids
    assert len(ids) == len(set(ids)) == per_writer * len(writers)  # exactly once
    by_writer: dict[str, list[int]] = defaultdict(list)
    for prompt_id in ids:
        writer, index = prompt_id.split("/")
        by_writer[writer].append(int(index))
    for writer in writers:  # per-writer order kept
        assert by_writer[writer] == list(range(per_writer))
    records = list(read_log(run_location))
    assert [r.seq for r in records] == list(range(len(writers) * per_writer // 8))


def test_sigkilled_writer_loses_no_committed_group_and_leaves_only_sweepable_orphans(
    run_uri_and_options, run_location: Location, backend: str, request
):
    uri, _ = run_uri_and_options
    env = _env(backend, request)
    total, segment = 120, 6
    rng = random.Random(7)
    reader = _BackgroundReader(run_location, idle_s=120)
    reader.start()

    committed_upto = -1
    for life in range(5):
        args = ["--groups", str(total), "--segment", str(segment)]
        proc = _start_writer(
            uri, "w0", env, *args, "--start", str(committed_upto + 1), "--pause-s", "0.3"
        )
        uploads_before_kill = rng.randint(1, 3)
        uploads = 0
        assert proc.stdout is not None
        for line in proc.stdout:
            kind, value, *_ = line.split()
            if kind == "committed":
                committed_upto = int(value)
            elif kind == "uploaded":
                uploads += 1
                if uploads == uploads_before_kill:  # mid-segment: uploaded, not committed
                    os.kill(proc.pid, signal.SIGKILL)
                    break
        proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL, f"life {life} ended before its kill"

    final = _start_writer(
        uri,
        "w0",
        env,
        "--groups",
        str(total),
        "--segment",
        str(segment),
        "--start",
        str(committed_upto + 1),
    )
    final.communicate(timeout=300)
    assert final.returncode == 0

    records = list(read_log(run_location))
    committed_groups = sum(r.num_groups for r in records)
    while len(reader.prompt_ids) < committed_groups and reader.is_alive():
        reader.join(timeout=0.5)
    reader.stop_event.set()
    assert reader.error is None, reader.error
    assert reader.reader.stats.quarantined == []  # never a partial segment

    seen = reader.prompt_ids
    assert len(seen) == committed_groups
    assert {f"w0/{i}" for i in range(total)} == set(seen)  # no committed group lost

    # Each kill left one uploaded-but-uncommitted segment; the sweeper removes exactly those.
    committed = {r.segment for r in records}
    stored = {
        p.split("/segments/")[1].split("/")[0]
        for p in run_location.fs.find(run_location.join("stream", "segments"))
    }
    orphans = stored - committed
    assert len(orphans) == 5
    grace = min_sweep_grace_s()  # the writers are dead: their orphans may as well be that old
    removed = sweep_orphans(run_location, grace, now=time.time() + grace)
    assert set(removed) == orphans
    left = {
        p.split("/segments/")[1].split("/")[0]
        for p in run_location.fs.find(run_location.join("stream", "segments"))
    }
    assert left == committed
