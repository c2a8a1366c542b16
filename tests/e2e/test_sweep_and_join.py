"""`streamrl sweep` removes only old uncommitted segments; generators joining a run claim
distinct indexes beyond the run's own; the `generator` flow joins a live run."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from storage.control.manifest import create_run
from storage.control.requests import request_stop
from storage.fs import open_location
from storage.stream.writer import StreamWriter, read_log
from streamrl.config.loading import load_config
from streamrl.generator.index import claim_generator_index, reserve_generator_indexes
from tests.stream_data import random_group

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path, *overrides: str):
    run_dir = tmp_path / "run"
    config = load_config(["dapo", "tiny-cpu"], overrides=[f"storage.run_uri={run_dir}", *overrides])
    run = open_location(str(run_dir))
    create_run(run, config.model_dump(mode="json"))
    return run_dir, run


def test_sweep_removes_only_uncommitted_segments_past_the_grace_period(tmp_path):
    run_dir, run = _run(tmp_path)
    StreamWriter(run, "gen0").write([random_group(np.random.default_rng(0), vocab=600)])
    orphan = run_dir / "stream" / "segments" / "gen9-dead-000000"
    orphan.mkdir(parents=True)
    (orphan / "zarr.json").write_text("{}")
    empty = run_dir / "stream" / "segments" / "gen8-dead-000000"  # killed before any object
    (empty / "rewards" / "c").mkdir(parents=True)
    old = time.time() - 7200
    for path in (orphan / "zarr.json", empty / "rewards" / "c", empty / "rewards", empty):
        os.utime(path, (old, old))

    def sweep(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "streamrl", "sweep", str(run_dir), *args],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    dry = sweep("--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "gen9-dead-000000" in dry.stdout
    assert "gen8-dead-000000" in dry.stdout
    assert orphan.exists()
    assert "0 orphaned" in sweep("--grace-s", "86400").stdout  # younger than the grace period
    too_short = sweep("--grace-s", "60")  # a segment that young may still be committed
    assert too_short.returncode == 2
    assert "use a grace of at least 600s (--grace-s)" in too_short.stderr
    done = sweep()
    assert "removed 2" in done.stdout
    assert not orphan.exists()
    assert not empty.exists()
    assert len(list(read_log(run))) == 1  # the committed segment is intact
    assert len(list((run_dir / "stream" / "segments").iterdir())) == 1


def test_joining_generators_claim_distinct_indexes_beyond_the_runs_own(tmp_path):
    _, run = _run(tmp_path, "generator.count=2")
    reserve_generator_indexes(run, 2)
    with ThreadPoolExecutor(8) as pool:
        claimed = list(pool.map(lambda _: claim_generator_index(run, first=2), range(8)))
    assert sorted(claimed) == list(range(2, 10))


# Slow: a Prefect server and a whole run; the generator flow also runs, as a run's child on a
# work pool, in tests/e2e/test_pools.py (slow too). Keeps the default suite near 15 minutes.
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_generator_flow_joins_a_run_and_stops_with_it(tmp_path):
    from prefect.testing.utilities import prefect_test_harness

    from flows.generator import join_run

    run_dir, run = _run(tmp_path, "generator.count=1", "generator.max_tokens=16")
    reserve_generator_indexes(run, 1)
    result: dict = {}
    with prefect_test_harness(server_startup_timeout=120):
        thread = threading.Thread(
            target=lambda: result.update(index=join_run(str(run_dir))), daemon=True
        )
        thread.start()
        deadline = time.monotonic() + 400
        while not any(True for _ in read_log(run)) and time.monotonic() < deadline:
            time.sleep(0.5)
        request_stop(run, "test over")
        thread.join(timeout=120)
    assert result["index"] == 1  # the run's own generator 0 keeps index 0
    segments = [p.name for p in (run_dir / "stream" / "segments").iterdir()]
    assert segments
    assert all(name.startswith("gen1-") for name in segments), segments
