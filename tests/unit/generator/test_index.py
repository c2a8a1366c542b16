"""Generator indexes: an explicit index is claimed like an automatic one, and held by one live
generator at a time (`streamrl.generator.index.hold_generator_index`) — a second refuses, a crashed
holder's index is free once its lease lapses, a supervisor restarting it takes it at once."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from storage.control.lease import NOT_HOLDER_EXIT_CODE
from storage.control.manifest import create_run
from storage.control.progress import read_progress
from storage.fs import Location, open_location
from streamrl.config.loading import load_config
from streamrl.generator.index import (
    GeneratorIndexHeldError,
    GeneratorIndexLostError,
    claim_generator_index,
    hold_generator_index,
    reserve_generator_indexes,
)

ROOT = Path(__file__).resolve().parents[3]
TTL_S = 2.0


def test_a_second_generator_on_a_live_index_refuses_naming_it_and_its_holder(
    run_location: Location,
) -> None:
    with hold_generator_index(run_location, 3, ttl_s=TTL_S) as held:
        started = time.monotonic()
        with pytest.raises(GeneratorIndexHeldError) as refused:
            hold_generator_index(run_location, 3, ttl_s=TTL_S)
        # It waited for the lease to lapse, saw it renewed and refused: within about a ttl.
        assert time.monotonic() - started < 3 * TTL_S
        message = str(refused.value)
        assert (
            f"another generator holds the lease on generator index 3 of run {run_location.uri}"
            in message
        )
        assert "renewed it" in message
        assert f"pid {os.getpid()}" in message
        assert "another --index" in message
        assert "--take-over" in message
        held.check()  # the holder still holds it

        # Another index is free.
        with hold_generator_index(run_location, 4, ttl_s=TTL_S):
            pass

        # A supervisor that saw the holder end takes it at once; the old holder commits nothing.
        started = time.monotonic()
        with hold_generator_index(run_location, 3, ttl_s=TTL_S, take_over=True) as successor:
            assert time.monotonic() - started < TTL_S
            with pytest.raises(GeneratorIndexLostError, match="generator 3 no longer holds"):
                held.check()
            successor.check()


def test_a_released_index_is_taken_at_once(tmp_path) -> None:
    run = open_location(str(tmp_path / "run"))
    with hold_generator_index(run, 0, ttl_s=30.0):
        pass
    started = time.monotonic()
    with hold_generator_index(run, 0, ttl_s=30.0):
        assert time.monotonic() - started < 5.0


def test_an_explicit_index_is_claimed_like_an_automatic_one(tmp_path) -> None:
    run = open_location(str(tmp_path / "run"))
    reserve_generator_indexes(run, 1)
    with hold_generator_index(run, 0, ttl_s=TTL_S), hold_generator_index(run, 2, ttl_s=TTL_S):
        pass
    # 2 was claimed by the explicit start: joining generators never get it.
    assert [claim_generator_index(run, first=1) for _ in range(2)] == [1, 3]


def _hold_in_a_process(run_dir: Path) -> subprocess.Popen[str]:
    code = (
        "import sys, time\n"
        "from storage.fs import open_location\n"
        "from streamrl.generator.index import hold_generator_index\n"
        f"hold_generator_index(open_location(sys.argv[1]), 0, ttl_s={TTL_S})\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_crashed_generators_index_is_taken_once_its_lease_lapses(tmp_path) -> None:
    run_dir = tmp_path / "run"
    holder = _hold_in_a_process(run_dir)
    holder.kill()  # SIGKILL: nothing released
    holder.wait()
    started = time.monotonic()
    with hold_generator_index(open_location(str(run_dir)), 0, ttl_s=TTL_S) as held:
        assert time.monotonic() - started < 3 * TTL_S
        assert held.lease.epoch == 2


def test_the_cli_refuses_an_index_another_generator_holds_before_loading_anything(
    tmp_path,
) -> None:
    run_dir = tmp_path / "run"
    run = open_location(str(run_dir))
    config = load_config(["dapo", "tiny-cpu"])
    create_run(run, config.model_dump(mode="json"))
    with hold_generator_index(run, 0, ttl_s=TTL_S):
        refused = subprocess.run(
            [sys.executable, "-m", "streamrl", "generator", "--run", str(run_dir), "--index", "0"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert refused.returncode == NOT_HOLDER_EXIT_CODE, refused.stderr[-3000:]
    assert (
        f"another generator holds the lease on generator index 0 of run {run_dir}" in refused.stderr
    )
    assert f"pid {os.getpid()}" in refused.stderr
    assert read_progress(run, "gen0") is None  # refused before its data shard was touched
