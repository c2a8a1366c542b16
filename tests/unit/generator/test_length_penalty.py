"""The adaptive length penalty (framework guide eqs 31–33) as a run uses it: its configuration
(`algorithm.length_penalty`, an alternative to overlong shaping) and the generator's records,
whose rewards it shapes while the raw scores stay the verifier's.

The math itself is checked against a looped reference in tests/unit/algorithms/test_shaping.py;
here the expected rewards are computed again from the formula, response by response.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import pytest

from streamrl.config.base import ConfigError
from streamrl.config.loading import load_config
from streamrl.config.run import RunConfig
from streamrl.data import Prompt
from streamrl.envs.base import Task
from streamrl.envs.runner import Episode, Scored
from streamrl.generator.engine import Completion
from streamrl.generator.records import GeneratorStats, GroupRecords
from streamrl.generator.rollouts import Rollout, Transcript


def problems(excinfo: pytest.ExceptionInfo[ConfigError]) -> str:
    return "\n".join(excinfo.value.problems)


def penalised(reward: float, sampled: int, config: RunConfig) -> float:
    """Eq 31 for one response: R_base − λ(R_base)·pen(|o|, R_base)."""
    p = config.algorithm.length_penalty
    assert p is not None
    ratio = sampled / config.length_penalty_target
    pen = p.a * math.log(1.0 + ratio) if reward > p.r_th else p.b * ratio**2
    return reward - p.lambda_base * math.exp(-p.gamma * max(0.0, reward - p.r_th)) * pen


# --- configuration ---------------------------------------------------------------------------


def test_off_by_default_and_defaults_resolve_against_max_tokens() -> None:
    for preset in ("grpo", "dapo", "vapo"):
        assert load_config([preset]).algorithm.length_penalty is None
    config = load_config(["grpo"], overrides=["algorithm.length_penalty={}"])
    penalty = config.algorithm.length_penalty
    assert penalty is not None
    assert penalty.target is None
    assert (penalty.a, penalty.b, penalty.r_th) == (1.0, 1.0, 0.0)
    assert (penalty.lambda_base, penalty.gamma) == (0.1, 1.0)
    assert config.length_penalty_target == config.generator.max_tokens // 2
    config = load_config(["grpo"], overrides=["algorithm.length_penalty.target=300"])
    assert config.length_penalty_target == 300
    config = load_config(["grpo"], overrides=["generator.max_tokens=1"])
    assert config.length_penalty_target == 1  # at least one token, never 0


@pytest.mark.parametrize("scale", ["plus_minus_one", "zero_one"])
def test_the_defaults_keep_every_correct_answer_above_every_wrong_one(scale: str) -> None:
    """Up to generator.max_tokens a correct answer pays at most ≈ 0.04, a wrong one at most
    0.4: length never outweighs correctness, on either reward scale."""
    config = load_config(
        ["grpo"],
        overrides=["algorithm.length_penalty={}", f"algorithm.reward_scale={scale}"],
    )
    correct, wrong = (1.0, -1.0) if scale == "plus_minus_one" else (1.0, 0.0)
    longest = config.generator.max_tokens
    worst_correct = penalised(correct, longest, config)
    assert worst_correct == pytest.approx(1.0 - 0.1 * math.exp(-1.0) * math.log(3.0))
    assert penalised(wrong, longest, config) == pytest.approx(wrong - 0.4)
    assert worst_correct > penalised(wrong, 0, config) == wrong


def test_length_penalty_and_overlong_shaping_are_alternatives() -> None:
    """DAPO shapes overlong responses by default: adding the length penalty is refused with a
    message naming both fields and the fix; with overlong shaping off it is accepted."""
    with pytest.raises(ConfigError) as excinfo:
        load_config(["dapo"], overrides=["algorithm.length_penalty={}"])
    text = problems(excinfo)
    assert "algorithm.length_penalty" in text
    assert "algorithm.overlong.shaping" in text
    assert "an alternative to overlong shaping: set one" in text
    config = load_config(
        ["dapo"], overrides=["algorithm.length_penalty={}", "algorithm.overlong.shaping=false"]
    )
    assert config.algorithm.length_penalty is not None
    assert not config.algorithm.overlong.shaping


def test_a_target_beyond_max_tokens_is_refused_for_single_turn_responses() -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(["grpo"], overrides=["algorithm.length_penalty.target=5000"])
    assert "algorithm.length_penalty.target (5000) must be ≤ generator.max_tokens" in problems(
        excinfo
    )
    # A multi-turn response samples over several turns, so it may outgrow max_tokens.
    config = load_config(
        ["grpo", "smollm2-cpu", "calculator"],
        overrides=["algorithm.length_penalty.target=5000"],
    )
    assert config.length_penalty_target == 5000


@pytest.mark.parametrize(
    "override",
    [
        "algorithm.length_penalty.target=0",
        "algorithm.length_penalty.a=-0.1",
        "algorithm.length_penalty.b=-1",
        "algorithm.length_penalty.r_th=1.5",
        "algorithm.length_penalty.lambda_base=0",
        "algorithm.length_penalty.gamma=-1",
    ],
)
def test_out_of_bounds_values_are_refused_naming_the_field(override: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(["grpo"], overrides=[override])
    assert override.split("=")[0] in problems(excinfo)


# --- the generator's records -----------------------------------------------------------------


def _completion(n: int) -> Completion:
    return Completion(
        token_ids=np.arange(n, dtype=np.int32) + 5,
        logprobs=np.full(n, -0.5, np.float32),
        text="x" * n,
        finish_reason="stop",
        versions=np.zeros(n, np.int64),
    )


def _rollout(turns: list[list[int]]) -> Rollout:
    """One group: response i samples the turns `turns[i]` tokens long, with a 4-token
    environment observation between two turns."""
    transcripts = []
    for sampled in turns:
        transcript = Transcript()
        for k, n in enumerate(sampled):
            if k:
                transcript.add_observation([1, 2, 3, 4])
            transcript.add_turn(_completion(n))
        transcripts.append(transcript)
    prompt = Prompt(prompt_id="math:0", text="1 + 3?", token_ids=[7, 8], ground_truth="4")
    return Rollout(
        prompt=prompt,
        key="math:0",
        prompt_ids=[7, 8],
        submitted_at=time.time(),
        episodes=[Episode(task=Task(messages=[], ground_truth="4")) for _ in turns],
        transcripts=transcripts,
    )


@pytest.mark.parametrize("scale", ["plus_minus_one", "zero_one"])
@pytest.mark.parametrize("multi_turn", [False, True])
def test_group_records_apply_the_length_penalty_to_rewards_not_to_raw_scores(
    scale: str, multi_turn: bool
) -> None:
    config = load_config(
        ["grpo"],
        overrides=[
            "algorithm.length_penalty={target: 8, lambda_base: 0.5, gamma: 2.0, a: 0.3}",
            f"algorithm.reward_scale={scale}",
        ],
    )
    turns = [[6, 4], [0], [12], [3, 9]] if multi_turn else [[10], [0], [12], [3]]
    raw = [1.0, 0.0, 0.0, 1.0]
    scored = [Scored(r, (), "done") for r in raw]
    stats = GeneratorStats()
    group = GroupRecords(config, "generator-0", stats).group(_rollout(turns), scored)

    rule = [2.0 * r - 1.0 if scale == "plus_minus_one" else r for r in raw]
    expected = [penalised(r, sum(t), config) for r, t in zip(rule, turns, strict=True)]
    np.testing.assert_allclose(group.rewards, expected, rtol=1e-6, atol=1e-6)
    assert group.rewards.dtype == np.float32
    np.testing.assert_array_equal(group.raw_scores, raw)  # dynamic sampling reads these
    assert (group.loss_masks is not None) == multi_turn
    assert stats.reward_sum == pytest.approx(sum(expected), abs=1e-5)
    assert stats.correct == 2


def test_group_records_without_the_penalty_keep_the_rule_rewards() -> None:
    config = load_config(["grpo"])
    scored = [Scored(r, (), "done") for r in (1.0, 0.0)]
    group = GroupRecords(config, "generator-0", GeneratorStats()).group(
        _rollout([[30], [2]]), scored
    )
    np.testing.assert_array_equal(group.rewards, [1.0, -1.0])


def test_a_group_records_whether_its_environment_offered_tools() -> None:
    config = load_config(["grpo"])
    scored = [Scored(0.0, (), "done")] * 2
    records = GroupRecords(config, "generator-0", GeneratorStats())
    assert not records.group(_rollout([[3], [2]]), scored).tools_offered
    rollout = _rollout([[3], [2]])
    rollout.episodes = [dataclasses.replace(e, tools_offered=True) for e in rollout.episodes]
    assert records.group(rollout, scored).tools_offered  # no call made: still watched
