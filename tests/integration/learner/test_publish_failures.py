"""A weight version that cannot be committed never stalls the loop: the learner retries the
upload, then fails naming the storage error — it never waits for data of a version no
generator can load (stream timeout), and no checkpoint records such a version."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from storage.checkpoints.dcp import CheckpointStore
from storage.fs import open_location
from storage.stream.writer import StreamWriter
from storage.weights.publish import WeightWriter
from storage.weights.versions import WeightStore
from streamrl.config.loading import load_config
from streamrl.learner.loop import Learner
from streamrl.learner.publish import PublishFailedError
from streamrl.learner.topology import Topology
from tests.stream_data import random_group

STREAM_TIMEOUT_S = 300.0  # far beyond what any of these tests may take


@pytest.fixture(scope="module")
def topology():
    topo = Topology.from_env("cpu")
    yield topo
    topo.destroy()


class FakeGenerator:
    """Writes a segment of 4 groups every 0.2 s, sampled (randomly) from the version LATEST
    names, as a generator that loads each committed version would."""

    def __init__(self, run_dir) -> None:
        self.run = open_location(str(run_dir))
        self.writer = StreamWriter(self.run, "gen0")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        rng, store, n = np.random.default_rng(0), WeightStore(self.run), 0
        while not self.stop.wait(0.2):
            version = store.latest_version() or 0
            groups = []
            for _ in range(4):
                groups.append(
                    random_group(
                        rng, prompt_id=f"p{n}", vocab=600, max_len=16, policy_version=version
                    )
                )
                n += 1
            self.writer.write(groups)

    def __enter__(self) -> FakeGenerator:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def _config(run_dir, max_staleness: int):
    return load_config(
        ["dapo", "tiny-cpu"],
        overrides=[
            f"storage.run_uri={run_dir}",
            "learner.total_steps=4",
            "learner.batch_groups=4",
            "learner.mini_batch_groups=4",
            "learner.checkpoint_every=1",
            f"learner.max_staleness={max_staleness}",
            f"learner.stream_timeout_s={STREAM_TIMEOUT_S}",
            "algorithm.dynamic_sampling=false",
            "weights.publish_attempts=2",
            "weights.keep_versions=10",
            "generator.max_tokens=16",
        ],
    )


def _failing_uploads(monkeypatch, fails: callable) -> list[int]:
    """Make `WeightWriter.write_share` raise for the calls `fails(version, call)` picks."""
    calls: list[int] = []
    real = WeightWriter.write_share

    def write_share(self, version, shares, **kwargs):
        calls.append(version)
        if fails(version, calls.count(version)):
            raise OSError(f"disk full (injected) writing v{version}")
        return real(self, version, shares, **kwargs)

    monkeypatch.setattr(WeightWriter, "write_share", write_share)
    return calls


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_one_failed_upload_is_retried_and_the_run_completes(
    tmp_path, topology, monkeypatch, max_staleness
):
    calls = _failing_uploads(monkeypatch, lambda version, call: version == 2 and call == 1)
    run = open_location(str(tmp_path))
    with FakeGenerator(tmp_path):
        learner = Learner(_config(tmp_path, max_staleness), run, topology)
        started = time.monotonic()
        assert learner.run() == 4
    assert time.monotonic() - started < STREAM_TIMEOUT_S / 2
    assert calls.count(2) == 2  # retried once
    assert WeightStore(run).versions() == [1, 2, 3, 4]
    assert learner.publisher.retries == 1
    for step in CheckpointStore(run).committed_steps():
        state = CheckpointStore(run).read_state(step)
        assert state.policy_version in WeightStore(run).versions()


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_a_version_that_never_commits_fails_the_learner_naming_the_storage_error(
    tmp_path, topology, monkeypatch, max_staleness
):
    _failing_uploads(monkeypatch, lambda version, call: True)
    run = open_location(str(tmp_path))
    with FakeGenerator(tmp_path):
        learner = Learner(_config(tmp_path, max_staleness), run, topology)
        started = time.monotonic()
        with pytest.raises(PublishFailedError) as failed:
            learner.run()
    assert time.monotonic() - started < 60  # never waits for the stream to time out
    message = str(failed.value)
    assert "weights v1 could not be committed" in message
    assert "disk full (injected) writing v1" in message
    assert "publish_attempts=2" in message
    assert WeightStore(run).versions() == []
    assert CheckpointStore(run).committed_steps() == []  # none records the phantom version
    assert learner.lease is None  # released: a restarted learner starts at once
