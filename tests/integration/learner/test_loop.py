"""The learner loop on the tiny model over a pre-written stream, one process: publishing,
checkpoints, metrics, the stop marker, and exact resume."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from storage.checkpoints.dcp import CheckpointStore
from storage.control.manifest import create_run
from storage.control.progress import GeneratorProgress, write_progress
from storage.control.requests import stop_requested
from storage.fs import Location, open_location
from storage.stream.learner_progress import read_learner_progress
from storage.stream.records import ScoredGroup
from storage.stream.writer import StreamTimeoutError, StreamWriter
from storage.weights.versions import WeightStore
from streamrl.config.loading import load_config
from streamrl.learner.loop import DivergedError, IncompatibleCheckpointError, Learner
from streamrl.learner.topology import Topology
from streamrl.runs.curves import curve_data, text_charts
from streamrl.runs.status_format import mismatch_summary
from tests.stream_data import RecordingFS, random_group

ROOT = Path(__file__).resolve().parents[3]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 (DTensor) parameter, or the tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


@pytest.fixture(scope="module")
def topology():
    topo = Topology.from_env("cpu")
    yield topo
    topo.destroy()


# Temporal groups (the guide's Alg. 5): each prompt's earlier rewards are learner state that a
# resume must restore exactly; the resume tests use them over a stream whose prompts repeat.
TEMPORAL = ("algorithm.advantage.kind=temporal", "algorithm.advantage.history=6")


def _config(run_dir, total_steps: int, *extra: str):
    return load_config(
        ["dapo", "tiny-cpu"],
        overrides=[
            f"storage.run_uri={run_dir}",
            f"learner.total_steps={total_steps}",
            "learner.batch_groups=4",
            "learner.mini_batch_groups=2",  # two updates per batch: proximal log-probs
            "learner.checkpoint_every=2",
            "learner.max_staleness=100",  # the pre-written stream is all version 0
            "learner.lr=1e-3",
            "generator.max_tokens=24",
            *extra,
        ],
    )


def _stream_groups(groups: int = 40, prompts: int | None = None) -> list[ScoredGroup]:
    """`groups` random groups, of `prompts` distinct prompt ids taken in turn (default: all
    distinct)."""
    rng = np.random.default_rng(0)
    return [
        random_group(rng, prompt_id=f"p{i % (prompts or groups)}", vocab=600, max_len=24,
                     prompt_len=10)
        for i in range(groups)
    ]  # fmt: skip


def _write_stream(run_dir, groups: int = 40, prompts: int | None = None) -> None:
    """`_stream_groups` in segments of 5."""
    writer = StreamWriter(open_location(str(run_dir)), "gen0")
    written = _stream_groups(groups, prompts)
    for first in range(0, len(written), 5):
        writer.write(written[first : first + 5])


def test_learner_publishes_checkpoints_logs_and_stops_the_run(tmp_path, topology):
    run_dir = tmp_path / "run"
    _write_stream(run_dir)
    run = open_location(str(run_dir))
    learner = Learner(_config(run_dir, total_steps=3), run, topology)
    assert learner.run() == 3
    assert WeightStore(run).versions() == [1, 2, 3]
    assert CheckpointStore(run).committed_steps() == [2, 3]
    assert stop_requested(run)
    lines = (run_dir / "metrics" / "learner.jsonl").read_text().splitlines()
    metrics = [json.loads(line) for line in lines]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert m["stream/accepted"] == 4
        assert m["stream/consumed"] == 4 + m["stream/dropped_zero_var"] + m["stream/dropped_stale"]
        assert np.isfinite(m["actor/pg_loss"])
        assert m["mismatch/kl_k3"] > 0  # the stream's log-probs are not the model's
        assert m["mismatch/ratio_min"] <= m["mismatch/ratio_mean"] <= m["mismatch/ratio_max"]
    # The stream is all version 0: fresh at step 1 only, so its KL is all groups' there.
    assert metrics[0]["mismatch/kl_k3_fresh"] == pytest.approx(metrics[0]["mismatch/kl_k3"])
    assert all("mismatch/kl_k3_fresh" not in m for m in metrics[1:])
    shown = mismatch_summary(metrics[-1])  # streamrl status's mismatch row
    assert shown.startswith(f"KL {metrics[-1]['mismatch/kl_k3']:.2e}  ratio max")
    charts = text_charts(curve_data(metrics))
    assert any(line.startswith("generator–learner mismatch") for line in charts)
    assert [e["condition"] for e in metrics[0]["health"]] == ["mismatch-high"]  # random data
    # The published weights are the learner's own, loadable as a full state dict.
    published, _ = WeightStore(run).load(3)
    for name, param in learner.models.policy.model.state_dict().items():
        torch.testing.assert_close(
            published[name], param.full_tensor() if hasattr(param, "full_tensor") else param
        )


def test_a_finished_learner_leaves_no_thread_reading_the_run(tmp_path, topology):
    """Once `run` returns, the stream reader's prefetch thread and the stop watcher end: a
    learner built again in the same process (tests, notebooks) does not poll the old run."""
    run_dir = tmp_path / "run"
    _write_stream(run_dir, groups=10)
    before = set(threading.enumerate())
    assert Learner(_config(run_dir, total_steps=1), open_location(str(run_dir)), topology).run()

    def lingering() -> set[str]:
        names = {t.name for t in set(threading.enumerate()) - before}
        return names & {"stream-prefetch", "stop-deadline"}

    deadline = time.monotonic() + 10  # the stop watcher looks once a second
    while lingering() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not lingering()


def test_length_aware_batches_close_at_batch_tokens(tmp_path, topology):
    run_dir = tmp_path / "run"
    _write_stream(run_dir)
    run = open_location(str(run_dir))
    config = _config(run_dir, 3, "learner.batch_tokens=100", "algorithm.dynamic_sampling=false")
    Learner(config, run, topology).run()
    metrics = [json.loads(line) for line in (run_dir / "metrics" / "learner.jsonl").open()]
    groups = _stream_groups()
    start = 0
    for m in metrics:  # reference: groups in stream order until 4 or ≥ 100 response tokens
        taken, tokens = 0, 0
        while taken < 4 and tokens < 100:
            tokens += sum(len(t) for t in groups[start + taken].response_tokens)
            taken += 1
        assert m["stream/accepted"] == taken < 4
        assert np.isfinite(m["actor/pg_loss"])
        start += taken


def test_resume_from_checkpoint_is_bit_identical(tmp_path, topology):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _write_stream(straight, prompts=5)
    shutil.copytree(straight, resumed)

    uninterrupted = Learner(_config(straight, 4, *TEMPORAL), open_location(str(straight)), topology)
    uninterrupted.run()

    first = Learner(_config(resumed, 2, *TEMPORAL), open_location(str(resumed)), topology)
    first.run()  # step 2 is checkpointed; the learner object is then thrown away
    second = Learner(_config(resumed, 4, *TEMPORAL), open_location(str(resumed)), topology)
    assert (second.state.step, second.state.version) == (2, 2)
    assert second.stream.reader.cursor == first.stream.reader.cursor
    assert second.state.rewards == first.state.rewards  # the prompts' earlier rewards
    assert len(second.state.rewards.rewards) == 5
    second.run()

    for (name, a), (_, b) in zip(
        uninterrupted.models.policy.model.state_dict().items(),
        second.models.policy.model.state_dict().items(),
        strict=True,
    ):
        assert torch.equal(_full(a), _full(b)), name


def test_an_ema_reference_takes_every_update_root_parameters_included(tmp_path, topology):
    """τ = 0: the reference is the policy after each step, its root parameters (embeddings,
    norm, head) too. An FSDP2 root keeps those gathered after a forward without backward, and
    an update written to the gathered copy was lost at the next reshard (a checkpoint)."""
    run_dir = tmp_path / "run"
    _write_stream(run_dir)
    ema = ("algorithm.kl.reference=ema", "algorithm.kl.ema_tau=0.0")
    learner = Learner(_config(run_dir, 2, *ema), open_location(str(run_dir)), topology)
    learner.run()
    policy = learner.models.policy.model.state_dict()
    reference = learner.models.reference.state_dict()
    assert policy.keys() == reference.keys()
    for name in policy:
        assert torch.equal(_full(policy[name]), _full(reference[name])), name


def test_a_damaged_newest_checkpoint_is_skipped_and_the_resume_from_the_previous_is_exact(
    tmp_path, topology
):
    straight, damaged = tmp_path / "straight", tmp_path / "damaged"
    _write_stream(straight)
    shutil.copytree(straight, damaged)
    uninterrupted = Learner(_config(straight, 6), open_location(str(straight)), topology)
    uninterrupted.run()

    Learner(_config(damaged, 4), open_location(str(damaged)), topology).run()
    shard = sorted((damaged / "checkpoints" / "step-00000004").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit flipped: the size is unchanged
    shard.write_bytes(bytes(data))

    resumed = Learner(_config(damaged, 6), open_location(str(damaged)), topology)
    assert (resumed.state.step, resumed.state.version) == (2, 2)  # checkpoint 4 skipped, reported
    assert resumed.checkpoints.store.damaged == [4]
    resumed.run()
    for (name, a), (_, b) in zip(
        uninterrupted.models.policy.model.state_dict().items(),
        resumed.models.policy.model.state_dict().items(),
        strict=True,
    ):
        assert torch.equal(_full(a), _full(b)), name
    assert CheckpointStore(open_location(str(damaged))).latest_verified() == 6


def _write_segments(writer: StreamWriter, versions: list[int], rng) -> list[str]:
    """One segment of 5 groups per entry of `versions`, sampled with that policy version."""
    return [
        writer.write(
            [
                random_group(
                    rng, prompt_id=f"v{v}", vocab=600, max_len=24, prompt_len=10, policy_version=v
                )
                for _ in range(5)
            ]
        ).segment
        for v in versions
    ]


def test_learner_records_its_progress_after_each_step_and_skips_stale_segments(tmp_path, topology):
    """After each step rank 0 rewrites `<run>/control/learner.json` (cursor, version, the
    step's and the run's groups). With max_staleness 0, version-0 groups are stale once step 1
    has published version 1: those already read are dropped one by one, the segments committed
    later (a slow generator's) are skipped unread, and all count as dropped_stale."""
    run_dir = tmp_path / "run"
    fs = RecordingFS()
    run = Location(fs, str(run_dir), str(run_dir))
    rng = np.random.default_rng(0)
    writer = StreamWriter(run, "gen0")
    early = _write_segments(writer, [0, 0, 0, 0], rng)
    config = _config(run_dir, total_steps=2)
    config.learner.max_staleness = 0
    learner = Learner(config, run, topology)
    assert read_learner_progress(run) is None

    first = learner.train_step()
    progress = read_learner_progress(run)
    assert (progress.step, progress.policy_version) == (1, 1)
    assert progress.cursor == learner.stream.reader.cursor
    assert (progress.consumed, progress.accepted, progress.dropped_stale) == (
        first["stream/consumed"],
        4,
        0,
    )
    assert progress.consumed < 20  # some version-0 groups are left for step 2

    late = _write_segments(writer, [0, 0], rng)  # stale when read: version is now 1
    fresh = _write_segments(writer, [1, 1, 1], rng)
    second = learner.train_step()
    progress = read_learner_progress(run)
    assert (progress.step, progress.policy_version) == (2, 2)
    assert progress.cursor == learner.stream.reader.cursor
    assert progress.dropped_stale == 20 - first["stream/consumed"] + 10
    assert progress.dropped_stale == second["stream/dropped_stale"]
    assert (progress.consumed, progress.accepted) == (second["stream/consumed"], 4)
    assert progress.consumed_total == first["stream/consumed"] + second["stream/consumed"]
    assert (progress.accepted_total, progress.dropped_stale_total) == (8, progress.dropped_stale)
    assert second["stream/skipped_segments"] == second["stream/skipped_segments_total"] == 2
    assert not set(late) & fs.segments_read()
    assert set(early) | set(fresh[:1]) <= fs.segments_read()


def test_a_learner_waiting_mid_step_records_where_it_waits(tmp_path, topology):
    """While a step waits for more groups, the progress record moves to the reader's cursor
    (`waiting`): the groups the step already consumed and rejected are no longer the
    generators' backlog, so flow control cannot pause them while the learner starves; and it
    says how many of the step's groups are accepted already (`pending_accepted`), so flow
    control does not admit a whole step's groups more at this version."""
    run_dir = tmp_path / "run"
    run = open_location(str(run_dir))
    writer = StreamWriter(run, "gen0")
    rng = np.random.default_rng(1)
    _write_segments(writer, [0, 0], rng)  # 10 groups: fewer than one batch
    for index, paused_s in enumerate((5.0, 2.5)):
        write_progress(run, GeneratorProgress(f"gen{index}", paused_s=paused_s, cpu_s=4 * paused_s))
    config = _config(run_dir, total_steps=1)
    config.learner.batch_groups = config.learner.mini_batch_groups = 12
    learner = Learner(config, run, topology)
    result: dict[str, object] = {}
    step = threading.Thread(target=lambda: result.update(learner.train_step()))
    step.start()
    deadline = time.monotonic() + 60
    while (progress := read_learner_progress(run)) is None or progress.cursor.seq < 2:
        assert time.monotonic() < deadline, f"no waiting record: {progress}"
        time.sleep(0.1)
    assert (progress.waiting, progress.step, progress.policy_version) == (True, 0, 0)
    assert progress.cursor == learner.stream.reader.cursor  # past all 10 groups, mid-step
    accepted = learner.stream.collector.pending_accepted  # the collector waits: settled
    while (progress := read_learner_progress(run)).pending_accepted != accepted:
        assert time.monotonic() < deadline, f"{progress} does not say {accepted} accepted"
        time.sleep(0.1)
    assert 0 < accepted < 12
    assert step.is_alive()
    _write_segments(writer, [0, 0, 0, 0], rng)
    step.join(timeout=120)
    assert result["step"] == 1
    assert result["generators/paused_s_total"] == 7.5  # from the generators' records
    assert result["generators/cpu_s_total"] == 30.0
    # The learner's own CPU over the step: it trained, so it used some, and no more than its
    # cores could give.
    assert result["perf/learner_cpu_s"] > 0
    assert 0 < result["perf/learner_cpu_util"] <= 1.0
    progress = read_learner_progress(run)
    assert (progress.waiting, progress.step, progress.accepted) == (False, 1, 12)
    assert progress.pending_accepted == 0  # the step is done: none held for the next one


def test_a_learner_training_on_a_full_batch_records_that_it_holds_it(tmp_path, topology):
    """Between collecting a batch and finishing its step, the reader idles at the end of the
    stream: its waiting record says the next step holds all B groups (`pending_accepted`), so
    flow control admits nothing more for this version; the record after the step holds none."""
    run_dir = tmp_path / "run"
    run = open_location(str(run_dir))
    _write_segments(StreamWriter(run, "gen0"), [0, 0], np.random.default_rng(2))
    config = _config(run_dir, 1, "algorithm.dynamic_sampling=false")
    learner = Learner(config, run, topology)
    batch, _ = learner.stream.next_batch()  # collected, not trained yet
    deadline = time.monotonic() + 60
    while not (progress := read_learner_progress(run)) or progress.pending_accepted != 4:
        assert time.monotonic() < deadline, f"no record of the batch held: {progress}"
        time.sleep(0.1)
    assert (progress.waiting, progress.step, progress.cursor) == (True, 0, batch.cursor_after)
    learner.stream.write_progress(batch)
    progress = read_learner_progress(run)
    assert (progress.waiting, progress.pending_accepted) == (False, 0)
    learner.release()


def _learner_process(run_dir, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "streamrl", "learner", "--run", str(run_dir), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_sigkilled_learner_resumes_to_bit_identical_weights(tmp_path):
    assert_sigkill_resume_is_exact(tmp_path, 8, TEMPORAL, groups=80, prompts=6)


def assert_sigkill_resume_is_exact(tmp_path, steps: int, extra, **stream) -> None:
    """Train one run straight through and another killed (SIGKILL) once its first checkpoint
    is committed, then resumed: their last published versions are bit-identical."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    for run_dir in (straight, killed):
        config = _config(run_dir, steps, *extra)
        create_run(open_location(str(run_dir)), config.model_dump(mode="json"))
        _write_stream(run_dir, **stream)

    proc = _learner_process(straight)
    _, errors = proc.communicate(timeout=300)
    assert proc.returncode == 0, errors

    proc = _learner_process(killed)
    checkpoints = CheckpointStore(open_location(str(killed)))
    deadline = time.monotonic() + 300
    while not checkpoints.committed_steps() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)  # mid-run: step 2 is committed, the last step is far
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert max(checkpoints.committed_steps()) < steps

    proc = _learner_process(killed, "--take-over")  # the killed one's lease is still live
    _, errors = proc.communicate(timeout=300)
    assert proc.returncode == 0, errors

    expected, _ = WeightStore(open_location(str(straight))).load(steps)
    actual, _ = WeightStore(open_location(str(killed))).load(steps)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


# -- VAPO, bad input ------------------------------------------------------------------------


def _vapo_config(run_dir, total_steps: int, pretrain_steps: int = 3, *extra: str):
    return load_config(
        ["vapo", "tiny-cpu"],
        overrides=[
            f"storage.run_uri={run_dir}",
            "model.critic.init_from=policy",
            f"learner.total_steps={total_steps}",
            "learner.batch_groups=4",
            "learner.mini_batch_groups=4",
            "learner.checkpoint_every=1",
            "learner.max_staleness=100",
            "learner.critic_lr=1e-3",
            f"algorithm.value_pretrain_steps={pretrain_steps}",
            "algorithm.value_pretrain_target_ev=1.0",
            "generator.max_tokens=24",
            *extra,
        ],
    )


# Weighted value integration (the guide's eqs 17–18): V_pre, the critic as pre-training left
# it, frozen and checkpointed, blended into the policy's GAE.
VALUE_PRIOR = ("algorithm.value_prior.w0=0.6", "algorithm.value_prior.ev_ema=0.5")


def test_vapo_learner_pretrains_the_critic_once_then_trains_both(tmp_path, topology):
    run_dir = tmp_path / "run"
    _write_stream(run_dir)
    run = open_location(str(run_dir))
    first = Learner(_vapo_config(run_dir, 1, 3, *VALUE_PRIOR), run, topology)
    policy_at_start = {
        k: _full(v).clone() for k, v in first.models.policy.model.state_dict().items()
    }
    history = first.pretrain_value()
    assert [m["value_pretrain_step"] for m in history] == [1, 2, 3]
    for name, value in first.models.policy.model.state_dict().items():  # policy frozen
        assert torch.equal(_full(value), policy_at_start[name]), name
    assert CheckpointStore(run).committed_steps() == [0]
    assert WeightStore(run).versions() == []  # nothing to publish: the policy is unchanged
    pretrained = {k: _full(v).clone() for k, v in first.models.critic.model.state_dict().items()}
    rel = 0.0  # rel_t: the EMA (0.5) of the clipped explained variance
    for m in history:
        rel = 0.5 * rel + 0.5 * min(max(m["critic/explained_var"], 0.0), 1.0)
        assert m["critic/reliability"] == pytest.approx(rel)
    first.release()  # this learner ends here

    resumed = Learner(_vapo_config(run_dir, 1, 3, *VALUE_PRIOR), run, topology)
    assert resumed.state.value_pretrained
    assert resumed.state.step == 0
    assert resumed.stream.reader.cursor == first.stream.reader.cursor  # three batches consumed
    assert resumed.state.value_reliability == first.state.value_reliability
    resumed.run()  # no second pre-training: straight to the policy step
    assert WeightStore(run).versions() == [1]
    lines = [
        json.loads(x) for x in (run_dir / "metrics" / "learner.jsonl").read_text().splitlines()
    ]
    assert [m.get("value_pretrain_step") for m in lines] == [1, 2, 3, None]
    assert {"actor/nll_loss", "critic/vf_loss", "critic/explained_var"} <= lines[-1].keys()
    # V_pre is the critic as pre-training left it, restored from the checkpoint and frozen
    # while the critic moves on; the policy's step weighed it w0 / (1 + η·rel) at t = 0.
    assert lines[-1]["critic/prior_weight"] == pytest.approx(0.6 / (1.0 + rel))
    prior = resumed.models.value_prior.model.state_dict()
    critic = resumed.models.critic.model.state_dict()
    assert all(torch.equal(_full(prior[k]), pretrained[k]) for k in pretrained)
    assert not all(torch.equal(_full(critic[k]), pretrained[k]) for k in pretrained)


def test_checkpoint_of_an_incompatible_config_is_refused_and_left_intact(tmp_path, topology):
    dapo_dir, vapo_dir = tmp_path / "dapo", tmp_path / "vapo"
    _write_stream(dapo_dir)
    Learner(_config(dapo_dir, total_steps=2), open_location(str(dapo_dir)), topology).run()
    shutil.copytree(dapo_dir, vapo_dir)  # a VAPO learner pointed at DAPO's checkpoints
    (vapo_dir / "control" / "STOP").unlink(missing_ok=True)
    before = {p: p.read_bytes() for p in (vapo_dir / "checkpoints").rglob("*") if p.is_file()}
    versions = WeightStore(open_location(str(vapo_dir))).versions()
    with pytest.raises(IncompatibleCheckpointError) as error:
        Learner(_vapo_config(vapo_dir, total_steps=4), open_location(str(vapo_dir)), topology)
    message = str(error.value)
    assert "critic: checkpoint False, this learner True" in message
    assert "step-00000002" in message
    assert "storage.run_uri" in message
    after = {p: p.read_bytes() for p in (vapo_dir / "checkpoints").rglob("*") if p.is_file()}
    assert after == before
    assert WeightStore(open_location(str(vapo_dir))).versions() == versions


def test_an_empty_stream_times_out_naming_the_stream_and_writes_nothing(tmp_path, topology):
    run_dir = tmp_path / "run"
    run = open_location(str(run_dir))
    config = _config(run_dir, total_steps=2)
    config.learner.stream_timeout_s = 1.0
    learner = Learner(config, run, topology)
    with pytest.raises(StreamTimeoutError, match=r"no new group .* for 1s.*streamrl generator"):
        learner.run()
    assert WeightStore(run).versions() == []
    assert CheckpointStore(run).committed_steps() == []
    assert not (run_dir / "metrics").exists()


# -- non-finite gradients -------------------------------------------------------------------


def _write_poisoned_stream(run_dir, poisoned: int, clean: int = 20) -> None:
    """`poisoned` groups whose rewards overflow float32 in the group mean (GRPO advantages and
    the loss become NaN), then `clean` ordinary groups."""
    rng = np.random.default_rng(1)
    groups = []
    for i in range(poisoned + clean):
        group = random_group(rng, prompt_id=f"p{i}", vocab=600, max_len=24, prompt_len=10)
        scores = np.array([1.0, 0.0, 1.0, 0.0], np.float32)  # mixed: dynamic sampling keeps it
        rewards = np.array([3e38, 3e38, 3e38, 2e38] if i < poisoned else 2 * scores - 1)
        fields = {**group.__dict__, "rewards": rewards.astype(np.float32), "raw_scores": scores}
        groups.append(ScoredGroup(**fields))
    StreamWriter(open_location(str(run_dir)), "gen0").write(groups)


def _assert_all_finite(state: dict[str, torch.Tensor]) -> None:
    for name, tensor in state.items():
        assert torch.isfinite(_full(tensor)).all(), name


def test_a_batch_with_infinite_loss_is_skipped_and_nothing_published_is_broken(tmp_path, topology):
    run_dir = tmp_path / "run"
    _write_poisoned_stream(run_dir, poisoned=4)  # the whole first batch (two updates)
    run = open_location(str(run_dir))
    config = _config(run_dir, total_steps=2)
    config.health.mismatch_kl_max = 1e9  # the stream's random log-probs are not the model's
    learner = Learner(config, run, topology)
    initial = {k: _full(v).clone() for k, v in learner.models.policy.model.state_dict().items()}
    learner.train_step()
    for name, value in learner.models.policy.model.state_dict().items():  # nothing applied
        assert torch.equal(_full(value), initial[name]), name
    learner.train_step()  # clean data trains again
    store = WeightStore(run)
    assert store.versions() == [1, 2]
    _assert_all_finite(store.load(1)[0])
    _assert_all_finite(store.load(2)[0])
    assert any(not torch.equal(store.load(2)[0][k], initial[k]) for k in initial)
    metrics = [
        json.loads(x) for x in (run_dir / "metrics" / "learner.jsonl").read_text().splitlines()
    ]
    assert [m["actor/skipped_updates"] for m in metrics] == [2, 0]
    assert [m["actor/skipped_updates_total"] for m in metrics] == [2, 2]
    assert not np.isfinite(metrics[0]["actor/grad_norm"])
    assert [e["condition"] for e in metrics[0]["health"]] == ["non-finite-update"]
    assert "health" not in metrics[1]


def test_too_many_skipped_updates_in_a_row_fail_the_learner_naming_step_and_fix(tmp_path, topology):
    run_dir = tmp_path / "run"
    _write_poisoned_stream(run_dir, poisoned=12)
    run = open_location(str(run_dir))
    config = _config(run_dir, total_steps=5)
    config.learner.max_skipped_updates = 3
    learner = Learner(config, run, topology)
    with pytest.raises(DivergedError, match=r"step 2: the last 4 actor optimiser updates") as e:
        learner.run()
    assert "lower learner.lr" in str(e.value)
    store = WeightStore(run)
    assert store.versions() == [1]  # step 1 published (unchanged weights); step 2 never
    _assert_all_finite(store.load(1)[0])
    assert CheckpointStore(run).committed_steps() == []
    lines = (run_dir / "metrics" / "learner.jsonl").read_text().splitlines()
    assert [json.loads(x)["actor/skipped_updates_total"] for x in lines] == [2, 4]


def test_a_health_condition_is_logged_and_recorded_once_and_not_again_after_resume(
    tmp_path, topology, caplog
):
    """length-runaway forced (its threshold below every response): step 1 records it and logs
    one warning; steps 2 and 3 (a resumed learner, seeded from the run's records) do not."""
    run_dir = tmp_path / "run"
    _write_stream(run_dir)
    run = open_location(str(run_dir))

    def learner(total_steps: int) -> Learner:
        config = _config(run_dir, total_steps)
        config.health.length_frac = 0.01  # threshold 0.24 tokens: every batch is over it
        config.health.waste_max = 1.0  # never: dynamic sampling's drops are random here
        config.health.mismatch_kl_max = 1e9  # never: the stream's log-probs are random
        return Learner(config, run, topology)

    with caplog.at_level(logging.WARNING, logger="streamrl.learner.loop"):
        learner(2).run()
        learner(3).run()
    records = [
        json.loads(x) for x in (run_dir / "metrics" / "learner.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [1, 2, 3]
    (event,) = records[0]["health"]
    assert event.keys() == {"condition", "step", "value", "threshold", "message"}
    assert (event["condition"], event["step"]) == ("length-runaway", 1)
    assert event["value"] == records[0]["rollout/response_len_mean"]
    assert event["threshold"] == pytest.approx(0.01 * 24)
    assert [r for r in records[1:] if "health" in r] == []
    warnings = [r.getMessage() for r in caplog.records if "health:" in r.getMessage()]
    assert warnings == [event["message"]]
    assert "rollout/response_len_mean" in event["message"]
