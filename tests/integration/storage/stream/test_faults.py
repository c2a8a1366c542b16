"""The replay stream under real faults: the S3 server dies and comes back mid-read; a sweeper
loops with the shortest grace it accepts while writer processes hold segments past their
commit deadline."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from storage.fs import Location, open_location
from storage.seaweedfs import SeaweedFS
from storage.stream.writer import (
    StreamReader,
    StreamWriter,
    min_sweep_grace_s,
    quarantined,
    read_log,
    sweep_orphans,
)
from tests.integration.storage.stream.test_processes import _BackgroundReader, _env, _start_writer
from tests.stream_data import random_group


def test_reader_rides_out_an_s3_server_restart_without_quarantining(tmp_path):
    with SeaweedFS(data_dir=tmp_path / "seaweedfs") as server:
        # s3fs's own retries would ride out the outage unseen: the reader's are tested here.
        options = {**server.storage_options, "retries": 1}
        run = open_location(f"s3://{server.bucket}/runs/restart", storage_options=options)
        writer = StreamWriter(run, "gen0")
        rng = np.random.default_rng(0)
        for s in range(12):
            writer.write([random_group(rng, prompt_id=f"gen0/{s}.{i}") for i in range(5)])
        undisturbed = list(_take(StreamReader(run), 60))

        reader = StreamReader(run, records_per_round=2, prefetch_rounds=2, max_retry_wait_s=1.0)
        groups = reader.groups(timeout_s=180)
        got = [next(groups) for _ in range(10)]
        server.kill()  # the reader's thread is a few rounds ahead: it meets the dead server
        restart = threading.Timer(3.0, server.start)
        restart.start()
        got += [next(groups) for _ in range(50)]
        restart.join()
        groups.close()

        assert len(got) == len(undisturbed) == 60
        assert all(a.equals(b) for a, b in zip(got, undisturbed, strict=True))
        assert reader.stats.transient_errors > 0  # the outage was met, and retried
        assert reader.stats.quarantined == []
        assert quarantined(run) == []


@pytest.mark.slow  # 40 s; the reader riding out a restart above covers the same retries
def test_an_s3_call_waits_out_a_short_outage(tmp_path):
    """A call that cannot reach the endpoint is retried (s3fs, about a minute in all), so
    every process of a run rides out a store restarting."""
    with SeaweedFS(data_dir=tmp_path / "seaweedfs") as server:
        run = open_location(
            f"s3://{server.bucket}/runs/outage", storage_options=server.storage_options
        )
        run.fs.pipe_file(run.join("x"), b"still here")
        server.kill()
        restart = threading.Timer(8.0, server.start)
        restart.start()
        try:
            assert run.fs.cat_file(run.join("x")) == b"still here"  # issued while it is down
        finally:
            restart.join()


def _take(reader: StreamReader, n: int):
    groups = reader.groups(timeout_s=30)
    return [next(groups) for _ in range(n)]


@pytest.mark.timeout(600)
def test_looping_sweeper_never_removes_a_segment_that_is_still_committed(
    run_uri_and_options, run_location: Location, backend: str, request
):
    """Every third segment is held 6 s between upload and commit: past the 1.5 s commit
    deadline and the sweeper's 4.5 s grace, so the sweeper removes it; its writer commits a
    fresh copy."""
    uri, _ = run_uri_and_options
    env = _env(backend, request)
    deadline_s, margin_s = 1.5, 3.0  # margin: S3's 1 s mtime resolution, commit latency
    grace_s = min_sweep_grace_s(deadline_s, margin_s)
    sweep = {"commit_deadline_s": deadline_s, "margin_s": margin_s}
    writers, per_writer, segment = ["w0", "w1", "w2"], 48, 6

    removed: list[str] = []
    sweeping, sweep_errors = threading.Event(), []

    def sweep_loop() -> None:
        try:
            while not sweeping.is_set():
                removed.extend(sweep_orphans(run_location, grace_s, **sweep))
                sweeping.wait(0.2)
        except BaseException as exc:
            sweep_errors.append(exc)

    sweeper = threading.Thread(target=sweep_loop, daemon=True)
    reader = _BackgroundReader(run_location, expected=per_writer * len(writers), idle_s=120)
    sweeper.start()
    reader.start()
    args = ["--groups", str(per_writer), "--segment", str(segment)]
    timing = ["--pause-s", "0.1,0.1,6", "--commit-deadline-s", str(deadline_s)]
    procs = [_start_writer(uri, w, env, *args, *timing) for w in writers]
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0]
    reader.join(timeout=180)
    sweeping.set()
    sweeper.join(timeout=60)

    assert sweep_errors == []
    assert reader.error is None, reader.error
    assert reader.reader.stats.quarantined == []
    ids = reader.prompt_ids
    assert sorted(ids) == sorted(f"{w}/{i}" for w in writers for i in range(per_writer))
    assert len(ids) == len(set(ids))  # exactly once

    uploaded = {
        line.split()[1] for out in outputs for line in out.splitlines() if "uploaded" in line
    }
    committed = {r.segment for r in read_log(run_location)}
    held = uploaded - committed  # uploaded, then found past the deadline and uploaded again
    assert len(held) >= 6  # two held segments per writer (more if an upload was slow)
    assert set(removed) <= held
    assert removed, "the sweeper never removed a held segment: the test proves nothing"
    final = sweep_orphans(run_location, grace_s, now=time.time() + grace_s, **sweep)
    assert set(removed) | set(final) == held
    stored = {
        p.split("/segments/")[1].split("/")[0]
        for p in run_location.fs.find(run_location.join("stream", "segments"))
    }
    assert stored == committed
