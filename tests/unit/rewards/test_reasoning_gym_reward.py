"""The `reasoning_gym` reward: the task's own scorer on the response's answer, the entry rebuilt
from the ground truth, responses written to break or stall it, malformed ground truths, and the
registered name resolved in real reward workers."""

from __future__ import annotations

import json
import random
import time
from typing import Any

import pytest

from streamrl.data.reasoning_gym import GymAnswer, ReasoningGymConfig, reasoning_gym_rows
from streamrl.rewards.reasoning_gym import (
    MAX_ANSWER_CHARS,
    _dataset,
    _tagged,
    reasoning_gym_reward,
)
from streamrl.rewards.scoring import RewardScorer

pytest.importorskip("reasoning_gym")

TASKS = ("leg_counting", "basic_arithmetic", "letter_counting", "chain_sum")


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    """Two prompts of each of TASKS, as the dataset builds them."""
    return reasoning_gym_rows(f"reasoning_gym:{','.join(TASKS)}", ReasoningGymConfig(size=8))


def _truth(row: dict[str, Any]) -> str:
    return row["reward_model"]["ground_truth"]


def _expected(row: dict[str, Any]) -> str:
    expected = GymAnswer.from_json(_truth(row)).expected
    assert expected is not None
    return expected


def _last_line(row: dict[str, Any]) -> str:
    """`row`'s ground truth asking for the response's last line as the answer."""
    return json.dumps({**json.loads(_truth(row)), "answer": "last_line"})


def test_the_right_answer_scores_1_and_a_wrong_or_missing_one_0(rows):
    for row in rows:
        truth, expected = _truth(row), _expected(row)
        assert reasoning_gym_reward(f"Let me think.\n<answer>{expected}</answer>", truth) == 1.0
        assert reasoning_gym_reward(f"<answer>\n {expected} \n</answer>", truth) == 1.0
        assert reasoning_gym_reward("<answer>wrong</answer>", truth) == 0.0
        assert reasoning_gym_reward(f"The answer is {expected}.", truth) == 0.0  # no tag
        assert reasoning_gym_reward(f"<answer>{expected}", truth) == 0.0  # never closed
        assert reasoning_gym_reward("", truth) == 0.0
        # the last tag is the answer
        assert reasoning_gym_reward(f"<answer>x</answer> <answer>{expected}</answer>", truth) == 1
        assert reasoning_gym_reward(f"<answer>{expected}</answer> <answer>x</answer>", truth) == 0


def test_last_line_mode_reads_the_responses_last_non_empty_line(rows):
    row = rows[0]
    truth, expected = _last_line(row), _expected(row)
    assert reasoning_gym_reward(f"Counting legs...\n{expected}\n\n  \n", truth) == 1.0
    assert reasoning_gym_reward(f"{expected}\nso I think 3", truth) == 0.0
    assert reasoning_gym_reward(f"<answer>{expected}</answer>\nwrong", truth) == 0.0
    assert reasoning_gym_reward(" \n\n", truth) == 0.0


def test_the_rebuilt_entry_is_the_one_the_prompt_showed(rows):
    assert {row["data_source"] for row in rows} == set(TASKS)
    for row in rows:
        truth = GymAnswer.from_json(_truth(row))
        settings = json.dumps(truth.config, sort_keys=True)
        entry = _dataset(truth.task, truth.seed, truth.size, settings)[truth.index]
        assert entry["question"] == row["prompt"][-1]["content"]
        assert str(entry["answer"]) == truth.expected
    # the held-out split's entries too (another seed, indices past the ones left out)
    held_out = reasoning_gym_rows(
        f"reasoning_gym:{','.join(TASKS)}", ReasoningGymConfig(size=8, eval_size=2, split="eval")
    )
    for row in held_out:
        assert reasoning_gym_reward(f"<answer>{_expected(row)}</answer>", _truth(row)) == 1.0


def test_a_response_written_to_stall_the_reward_is_scored_quickly(rows):
    truth, expected = _truth(rows[0]), _expected(rows[0])
    responses = {
        "a million characters": "x" * 1_000_000,
        "thousands of unclosed tags": "<answer>" * 5_000 + "y" * 960_000,
        "unclosed tags all along": "<answer>" * 125_000,
        "closing tags all along": "</answer>" * 110_000,
        "an answer, then unclosed tags": f"<answer>{expected}</answer>" + "<answer>" * 100_000,
        "a huge last line": "z" * 1_000_000,
    }
    for name, response in responses.items():
        start = time.perf_counter()
        score = reasoning_gym_reward(response, truth)
        assert time.perf_counter() - start < 1.0, name
        assert score == (1.0 if name == "an answer, then unclosed tags" else 0.0), name
    start = time.perf_counter()
    assert reasoning_gym_reward("w\n" * 500_000, _last_line(rows[0])) == 0.0
    assert time.perf_counter() - start < 1.0


def test_an_answer_longer_than_the_limit_scores_0_without_reaching_the_scorer(rows):
    row = rows[0]
    truth, expected = _truth(row), _expected(row)
    padded = expected + " " * (MAX_ANSWER_CHARS + 10)  # stripped: still the right answer
    assert reasoning_gym_reward(f"<answer>{padded}</answer>", truth) == 1.0
    assert (
        reasoning_gym_reward(f"<answer>{expected + ' 0' * MAX_ANSWER_CHARS}</answer>", truth) == 0
    )
    # containing the right answer is not enough past the limit, even in last-line mode
    assert reasoning_gym_reward(expected + " 1" * MAX_ANSWER_CHARS, _last_line(row)) == 0.0


def test_several_answers_in_one_tag_are_not_the_answer(rows):
    """reasoning-gym's default scorer gives partial credit to an answer that contains the right
    one; listing candidates never scores as the right answer alone, nor counts as correct."""
    for row in rows:
        truth, expected = _truth(row), _expected(row)
        candidates = ", ".join(str(n) for n in range(-300, 1000))
        assert expected in candidates or row["data_source"] != "leg_counting"
        assert reasoning_gym_reward(f"<answer>{candidates}</answer>", truth) < 0.01
        assert reasoning_gym_reward(f"<answer>{expected} or 7</answer>", truth) < 1.0
        assert reasoning_gym_reward(f"<answer>{expected}</answer{expected}>", truth) == 0.0


def test_a_hedged_answer_scores_0_unless_partial_credit_is_asked_for(rows):
    """leg_counting's scorer pays 0.5 for "<answer>, 7": a policy would learn to hedge."""
    row = next(r for r in rows if r["data_source"] == "leg_counting")
    hedged = f"<answer>{_expected(row)}, 7</answer>"
    assert reasoning_gym_reward(hedged, _truth(row)) == 0.0
    partial = json.dumps({**json.loads(_truth(row)), "partial_credit": True})
    assert reasoning_gym_reward(hedged, partial) == pytest.approx(0.5)
    assert reasoning_gym_reward(f"<answer>{_expected(row)}</answer>", partial) == 1.0


def test_the_tag_is_read_as_reasoning_gyms_extract_answer_reads_it():
    from reasoning_gym.utils import extract_answer

    pieces = ["<answer>", "</answer>", "<answer", "answer>", "a", "17", " ", "\n", "<", ">", "/"]
    rng = random.Random(0)
    for _ in range(3000):
        response = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        assert _tagged(response) == extract_answer(response), response


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"task": 5}, "not a reasoning-gym ground truth"),
        ({"task": "no_such_task"}, "'no_such_task' not registered"),
        ({"index": -1}, "entry -1 is outside task leg_counting's"),
        ({"index": 10**6}, "entry 1000000 is outside"),
        ({"index": "0"}, "not a reasoning-gym ground truth"),
        ({"index": True}, "not a reasoning-gym ground truth"),
        ({"seed": "x"}, "not a reasoning-gym ground truth"),
        ({"size": None}, "not a reasoning-gym ground truth"),
        ({"config": [1]}, "not a reasoning-gym ground truth"),
        ({"config": {"max_animalz": 4}}, "leg_counting refused the ground truth's settings"),
        ({"answer": "elsewhere"}, "not a reasoning-gym ground truth"),
        ({"expected": 278}, "not a reasoning-gym ground truth"),
        ({"extra": 1}, "unexpected keyword argument 'extra'"),
    ],
    ids=repr,
)
def test_a_malformed_ground_truth_raises_value_error(rows, change: dict[str, Any], match: str):
    row = next(r for r in rows if r["data_source"] == "leg_counting")
    truth = json.dumps({**json.loads(_truth(row)), **change})
    with pytest.raises(ValueError, match=match):
        reasoning_gym_reward(f"<answer>{_expected(row)}</answer>", truth)


@pytest.mark.parametrize("truth", ["", "12", "not json", "[]", "{}", '{"task": "leg_counting"}'])
def test_a_ground_truth_that_is_no_record_raises_value_error(truth: str):
    with pytest.raises(ValueError, match="not a reasoning-gym ground truth"):
        reasoning_gym_reward("<answer>12</answer>", truth)


def test_the_registered_reward_scores_in_reward_workers(rows):
    picked = rows[:4]
    responses = [f"<answer>{_expected(r)}</answer>" for r in picked[:3]] + ["no answer"]
    with RewardScorer("reasoning_gym", workers=1, timeout_s=30.0) as scorer:
        scores = scorer.score(responses, [_truth(r) for r in picked], prompts=["p"] * 4)
    assert scores.values == [1.0, 1.0, 1.0, 0.0]
    assert not scores.any_failed
