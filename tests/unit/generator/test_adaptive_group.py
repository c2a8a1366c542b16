"""Adaptive group size (the framework guide's eq 27): the rule against a plain-loop reference,
its clamps, sampled-token lengths of multi-turn responses, seeds, and the config's errors."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from streamrl.config.base import ConfigError
from streamrl.config.loading import load_config
from streamrl.data import Prompt
from streamrl.generator.engine import Completion, request_seed
from streamrl.generator.group_size import AdaptiveGroupSize, FixedGroupSize
from streamrl.generator.rollouts import Rollout, Transcript


def reference_sizes(
    lengths_per_group: list[list[int]],
    *,
    base: int,
    ref_length: int,
    min_size: int,
    max_size: int,
    ema: float,
) -> list[int]:
    """G before each group and after the last one: G = clamp(⌊base·L_ref/ℓ⌋, G_min, G_max),
    ℓ = L_ref, then ℓ = ema·ℓ + (1 − ema)·mean(lengths) after each group."""
    ell = float(ref_length)
    sizes = []
    for lengths in [*lengths_per_group, None]:
        g = math.floor(base * ref_length / ell) if ell > 0 else max_size
        if g < min_size:
            g = min_size
        if g > max_size:
            g = max_size
        sizes.append(int(g))
        if lengths is not None:
            ell = ema * ell + (1 - ema) * (sum(lengths) / len(lengths))
    return sizes


def sizes_of(rule: AdaptiveGroupSize, lengths_per_group: list[list[int]]) -> list[int]:
    sizes = []
    for lengths in lengths_per_group:
        sizes.append(rule.size())
        rule.observe(lengths)
    return [*sizes, rule.size()]


@pytest.mark.parametrize("seed", range(6))
def test_the_rule_equals_the_reference_loop(seed: int) -> None:
    rng = random.Random(seed)
    params = {
        "base": rng.randint(1, 16),
        "ref_length": rng.randint(1, 500),
        "min_size": rng.randint(2, 6),
        "ema": rng.choice([0.0, 0.5, 0.9, 0.99]),
    }
    params["max_size"] = params["min_size"] + rng.randint(0, 30)
    groups = []
    for _ in range(200):
        size = rng.randint(1, 12)
        scale = rng.choice([1, 10, 100, 1000])
        groups.append([rng.randint(0, scale) for _ in range(size)])
    assert sizes_of(AdaptiveGroupSize(**params), groups) == reference_sizes(groups, **params)


def test_before_any_group_g_is_g_base_clamped() -> None:
    assert AdaptiveGroupSize(8, 300, 2, 16, 0.9).size() == 8
    assert AdaptiveGroupSize(8, 300, 10, 16, 0.9).size() == 10  # G_base below G_min
    assert AdaptiveGroupSize(8, 300, 2, 6, 0.9).size() == 6  # G_base above G_max
    rule = AdaptiveGroupSize(8, 300, 2, 16, 0.9)
    assert rule.mean_length == 300.0
    assert rule.groups_seen == 0


def test_long_responses_hit_g_min_and_short_ones_g_max() -> None:
    rule = AdaptiveGroupSize(base=8, ref_length=100, min_size=3, max_size=20, ema=0.5)
    for _ in range(20):
        rule.observe([10_000, 20_000])
    assert rule.size() == 3
    rule = AdaptiveGroupSize(base=8, ref_length=100, min_size=3, max_size=20, ema=0.5)
    for _ in range(20):
        rule.observe([1, 2, 3])
    assert rule.size() == 20
    # ℓ = 0 (only with ema = 0 and no sampled token at all): the formula's limit, G_max.
    rule = AdaptiveGroupSize(base=8, ref_length=100, min_size=3, max_size=20, ema=0.0)
    rule.observe([0, 0])
    assert rule.mean_length == 0.0
    assert rule.size() == 20


def test_one_ema_step_and_the_floor() -> None:
    rule = AdaptiveGroupSize(base=4, ref_length=10, min_size=2, max_size=64, ema=0.75)
    rule.observe([2, 4])  # mean 3: ℓ = 0.75·10 + 0.25·3 = 8.25
    assert rule.mean_length == pytest.approx(8.25)
    assert rule.size() == 4  # ⌊40 / 8.25⌋ = ⌊4.85⌋
    rule.observe([1, 1, 1, 1])  # ℓ = 0.75·8.25 + 0.25 = 6.4375 → ⌊6.21⌋
    assert rule.size() == 6
    assert rule.groups_seen == 2


def test_fixed_group_size_ignores_lengths() -> None:
    rule = FixedGroupSize(5)
    rule.observe([1000, 1])
    assert rule.size() == 5
    assert rule.describe() == "G=5"


def _completion(n: int, version: int = 0) -> Completion:
    return Completion(
        token_ids=np.arange(n, dtype=np.int32),
        logprobs=np.zeros(n, np.float32),
        text="",
        finish_reason="stop",
        versions=np.full(n, version, np.int64),
    )


def test_multi_turn_lengths_count_sampled_tokens_only() -> None:
    first, second = Transcript(), Transcript()
    first.add_turn(_completion(5))
    first.add_observation(list(range(40)))  # a tool result: not sampled
    first.add_turn(_completion(7))
    second.add_turn(_completion(3))
    prompt = Prompt(prompt_id="p", text="q", token_ids=[1, 2], ground_truth="1")
    rollout = Rollout(prompt, key="g0", prompt_ids=[1, 2], submitted_at=0.0)
    rollout.transcripts = [first, second]
    assert (first.length, first.sampled) == (52, 12)
    assert rollout.sampled_lengths() == [12, 3]
    # The loss masks the stream record stores agree.
    assert [int(t.arrays()[2].sum()) for t in rollout.transcripts] == [12, 3]

    rule = AdaptiveGroupSize(base=4, ref_length=10, min_size=2, max_size=16, ema=0.0)
    rule.observe(rollout.sampled_lengths())  # ℓ = 7.5 → ⌊40 / 7.5⌋ = 5
    assert rule.size() == 5  # with the tool tokens ℓ would be 27.5 → 2


def test_variable_group_sizes_never_share_a_sample_seed() -> None:
    rule = AdaptiveGroupSize(base=4, ref_length=8, min_size=2, max_size=9, ema=0.3)
    rng = random.Random(0)
    engine_seed = 2**63 - 50  # wraps around the modulus too
    seeds: list[int] = []
    for request in range(300):
        n = rule.size()
        start = request_seed(engine_seed, request, rule.max_size)
        seeds.extend(start + i for i in range(n))
        rule.observe([rng.randint(1, 30) for _ in range(n)])
    assert len(set(seeds)) == len(seeds)


# --- configuration ---------------------------------------------------------------------------


def _config(*overrides: str):
    return load_config(["dapo", "tiny-cpu"], overrides=list(overrides)).generator


def test_off_by_default() -> None:
    generator = _config()
    assert generator.adaptive_group is None
    assert generator.group_size_rule() == FixedGroupSize(generator.group_size)
    assert generator.largest_group_size == generator.group_size


def test_defaults_when_on() -> None:
    generator = _config("generator.group_size=6", "generator.adaptive_group.ref_length=300")
    rule = generator.group_size_rule()
    assert isinstance(rule, AdaptiveGroupSize)
    assert (rule.base, rule.ref_length, rule.min_size, rule.max_size, rule.ema) == (
        6,
        300,
        2,
        12,
        0.9,
    )
    assert generator.largest_group_size == 12
    assert "adaptive" in rule.describe()
    # G_max defaults to 2 × group_size but never below min_size.
    generator = _config(
        "generator.group_size=2",
        "generator.adaptive_group.ref_length=300",
        "generator.adaptive_group.min_size=7",
    )
    assert generator.group_size_rule().max_size == 7
    # A G_max below group_size still leaves room for a request of group_size samples.
    generator = _config(
        "generator.group_size=8",
        "generator.adaptive_group.ref_length=300",
        "generator.adaptive_group.max_size=4",
    )
    assert (generator.group_size_rule().max_size, generator.largest_group_size) == (4, 8)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["generator.adaptive_group.min_size=3"],
            r"adaptive_group\.ref_length \(L_ref\) is required",
        ),
        (["generator.adaptive_group={}"], r"ref_length=512"),
        (
            ["generator.adaptive_group.ref_length=100", "generator.adaptive_group.ref_length=0"],
            r"generator\.adaptive_group\.ref_length: .*greater than 0",
        ),
        (
            ["generator.adaptive_group.ref_length=100", "generator.adaptive_group.min_size=1"],
            r"generator\.adaptive_group\.min_size: .*greater than or equal to 2",
        ),
        (
            [
                "generator.adaptive_group.ref_length=100",
                "generator.adaptive_group.min_size=9",
                "generator.adaptive_group.max_size=4",
            ],
            r"min_size \(9\) must be ≤ generator\.adaptive_group\.max_size \(4\); lower min_size",
        ),
        (
            ["generator.adaptive_group.ref_length=100", "generator.adaptive_group.ema=1"],
            r"generator\.adaptive_group\.ema: .*less than 1",
        ),
        (
            ["generator.adaptive_group.ref_length=100", "generator.adaptive_group.max_size=5000"],
            r"generator\.adaptive_group\.max_size",
        ),
        (
            ["generator.adaptive_group.ref_length=100", "generator.adaptive_group.size=4"],
            r"generator\.adaptive_group\.size: unknown field",
        ),
    ],
)
def test_config_errors_name_the_field(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(*overrides)


def test_g_base_of_one_is_allowed_when_g_min_keeps_groups_of_two() -> None:
    with pytest.raises(ConfigError, match=r"generator\.adaptive_group"):
        load_config(["grpo", "tiny-cpu"], overrides=["generator.group_size=1"])
    config = load_config(
        ["grpo", "tiny-cpu"],
        overrides=["generator.group_size=1", "generator.adaptive_group.ref_length=64"],
    )
    assert config.generator.smallest_group_size == 2
    assert config.generator.group_size_rule().size() == 2  # clamp(1, 2, G_max)
