"""A run on S3 rides out a storage outage: `streamrl run` with the learner and two generators on
SeaweedFS, whose server is killed for 20 s mid-run and started again on the same ports and data.
The run must complete (exit 0: no component failed for good; restarts are allowed), its commit
log must hold every committed group exactly once (gap-free, nothing quarantined, no group
committed twice), and the learner's final weights must equal, bit for bit, those of a learner
replaying that stream offline — the outage changed when things happened, not what was trained.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from storage.control.manifest import create_run
from storage.fs import Location, open_location
from storage.seaweedfs import SeaweedFS
from storage.stream.records import ScoredGroup
from storage.stream.writer import StreamReader, read_log
from storage.weights.versions import WeightStore
from streamrl.config.stored import load_run_config

ROOT = Path(__file__).resolve().parents[2]
TOTAL_STEPS = 14
DOWN_AT_STEP = 3  # the learner's step that has just finished when the server is killed
OUTAGE_S = 20.0
TINY = [
    "generator.max_tokens=16",
    "learner.batch_groups=2",
    "learner.mini_batch_groups=2",
    "learner.checkpoint_every=2",
    "algorithm.dynamic_sampling=false",
]
_STEP = re.compile(r"^\[learner\] step (\d+)/")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


class _Outage:
    """Kills the server once `DOWN_AT_STEP` is reported, starts it again `OUTAGE_S` later."""

    def __init__(self, server: SeaweedFS, run: subprocess.Popen[str]) -> None:
        self.server, self.run = server, run
        self.steps_before: int | None = None  # the learner's step when the server went down
        self.run_alive_after = False  # the run was still going when the server came back
        self.error: BaseException | None = None
        self._restart = threading.Thread(target=self._restart_later, daemon=True)

    def see(self, line: str) -> None:
        step = _STEP.match(line)
        if self.steps_before is None and step and int(step[1]) >= DOWN_AT_STEP:
            self.steps_before = int(step[1])
            self.server.kill()
            self._restart.start()

    def _restart_later(self) -> None:
        try:
            time.sleep(OUTAGE_S)
            self.server.start()
            self.run_alive_after = self.run.poll() is None
        except BaseException as exc:
            self.error = exc

    def join(self) -> None:
        if self.steps_before is not None:
            self._restart.join(timeout=300)


def _streamrl_run(uri: str, server: SeaweedFS, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "streamrl", "run", "--preset", "dapo", "--preset", "tiny-cpu",
         "--generators", "2", f"storage.run_uri={uri}", f"learner.total_steps={TOTAL_STEPS}",
         *TINY],
        cwd=cwd,  # logs of a run on S3 go to ./streamrl-logs/
        env={**os.environ, **server.env, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip


def _logs(folder: Path) -> str:
    return "".join(
        f"\n--- {log.name} ---\n" + "".join(log.read_text().splitlines(True)[-15:])
        for log in sorted(folder.glob("streamrl-logs/*/*.log"))
    )


def _identity(group: ScoredGroup) -> tuple:
    """What tells a group apart from every other one ever generated (restarted generators
    draw new seeds): committed twice, a group has the same identity twice."""
    responses = tuple(tokens.tobytes() for tokens in group.response_tokens)
    return (group.generator_id, group.prompt_id, group.created_at, responses)


def _check_stream(run: Location) -> int:
    """Every committed group, read once in commit order: the number of groups."""
    groups = committed_groups(run)
    assert {group.generator_id for group in groups} == {"gen0", "gen1"}
    return len(groups)


def committed_groups(run: Location) -> list[ScoredGroup]:
    """Every committed group, read once in commit order, checked: the commit log is gap-free,
    no segment is committed twice or quarantined, no group appears twice."""
    log = run.join("stream", "log")
    seqs = sorted(int(path.rsplit("/", 1)[1].removesuffix(".json")) for path in run.fs.ls(log))
    records = list(read_log(run))
    assert seqs == list(range(len(seqs))), "the commit log has a gap"
    assert [record.seq for record in records] == seqs
    segments = [record.segment for record in records]
    assert len(set(segments)) == len(segments), "a segment was committed twice"

    expected = sum(record.num_groups for record in records)
    reader = StreamReader(run)
    stream = reader.groups(timeout_s=60)
    groups = [next(stream) for _ in range(expected)]
    stream.close()
    assert reader.stats.quarantined == [], "committed segments were lost"
    identities = {_identity(group) for group in groups}
    assert len(identities) == len(groups), "a group was committed twice"
    return groups


def _replay_offline(run: Location, folder: Path) -> Location:
    """A fresh local run holding the stream of `run`, trained by a learner alone."""
    replay = open_location(str(folder))
    config = load_run_config(run)
    config.storage.run_uri = str(folder)
    create_run(replay, config.model_dump(mode="json"))
    run.fs.get(run.join("stream") + "/", str(folder / "stream"), recursive=True)
    learner = subprocess.run(
        [sys.executable, "-m", "streamrl", "learner", "--run", str(folder)],
        cwd=folder,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert learner.returncode == 0, learner.stderr[-3000:]
    return replay


def test_a_run_rides_out_a_storage_outage(tmp_path: Path) -> None:
    with SeaweedFS(data_dir=tmp_path / "seaweedfs") as server:
        uri = f"s3://{server.bucket}/runs/outage"
        started = time.monotonic()
        process = _streamrl_run(uri, server, tmp_path)
        outage = _Outage(server, process)
        output = []
        for line in process.stdout:
            output.append(line)
            outage.see(line)
        code = process.wait(timeout=600)
        outage.join()
        wall_s = time.monotonic() - started
        shown = "".join(output[-30:]) + _logs(tmp_path)
        assert outage.error is None, f"{outage.error!r}\n{shown}"
        assert code == 0, shown  # no component failed for good
        assert outage.steps_before is not None, shown
        assert outage.steps_before < TOTAL_STEPS, shown
        assert outage.run_alive_after, "the run ended before the server came back"
        restarts = [line.strip() for line in output if "exited with code" in line]
        print(f"run: {wall_s:.0f}s, down after step {outage.steps_before}, restarts: {restarts}")

        run = open_location(uri, storage_options=server.storage_options)
        assert _check_stream(run) >= TOTAL_STEPS * 2  # batch_groups groups a step at least
        store = WeightStore(run)
        assert store.latest_version() == TOTAL_STEPS
        trained, _ = store.load(TOTAL_STEPS)
        replay = _replay_offline(run, tmp_path / "replay")

    replayed, _ = WeightStore(replay).load(TOTAL_STEPS)
    assert trained.keys() == replayed.keys()
    for name, tensor in trained.items():
        assert torch.equal(tensor, replayed[name]), name
