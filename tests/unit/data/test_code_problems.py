"""The bundled code problems (`streamrl.data.code_problems`): a few hundred of graded
difficulty, a held-out split that shares no problem with training, tests every row's reward
can read, and expected outputs that independently written solutions reproduce in the box."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from streamrl.data.builtin import builtin_rows
from streamrl.rewards.code.cases import read_tests
from streamrl.rewards.code.config import CodeRewardConfig
from streamrl.rewards.code.reward import CodeReward

TRAIN, TEST = builtin_rows("code"), builtin_rows("code-test")

# Written from each template's wording, not from its reference: {k} is the row's parameter.
SOLUTIONS = {
    "times_k": "def times_k(x):\n    return x * {k}",
    "fizz_k": "def fizz_k(n):\n    return 'Fizz' if n % {k} == 0 else str(n)",
    "run_length": (
        "from itertools import groupby\n"
        "def run_length(s):\n    return ''.join(c + str(len(list(g))) for c, g in groupby(s))"
    ),
    "kth_largest": "def kth_largest(xs):\n    return sorted(xs)[-{k}]",
    "gcd_plus_k": "import math\ndef gcd_plus_k(a, b):\n    return math.gcd(a, b) + {k}",
    "stdin_sum_k": "a, b = map(int, input().split())\nprint(a + b + {k})",
    "stdin_reverse_k": "w = input().strip()[::-1]\nprint(' '.join([w] * {k}))",
}


def test_a_few_hundred_problems_at_three_levels_in_both_splits() -> None:
    assert len(TRAIN) >= 200
    assert len(TEST) >= 50
    for rows in (TRAIN, TEST):
        assert set(Counter(row["extra_info"]["level"] for row in rows)) == {1, 2, 3}


def test_the_held_out_split_shares_no_problem_with_training() -> None:
    def prompts(rows: list[dict]) -> set[str]:
        return {row["prompt"][0]["content"] for row in rows}

    def problems(rows: list[dict]) -> set[tuple[str, int]]:
        return {(row["extra_info"]["template"], row["extra_info"]["k"]) for row in rows}

    assert prompts(TRAIN).isdisjoint(prompts(TEST))
    assert problems(TRAIN).isdisjoint(problems(TEST))
    assert len(prompts(TRAIN)) == len(TRAIN)  # no problem twice
    assert {t for t, _ in problems(TEST)} == {t for t, _ in problems(TRAIN)}


@pytest.mark.parametrize("rows", [TRAIN, TEST], ids=["code", "code-test"])
def test_every_problem_has_a_public_example_and_hidden_tests_that_tell_answers_apart(rows) -> None:
    for row in rows:
        tests = read_tests(row["reward_model"]["ground_truth"])
        assert (len(tests.public), len(tests.hidden)) == (1, 5)
        answers = {json.dumps(getattr(t, "expected", None) or getattr(t, "stdout", None))
                   for t in tests.all}  # fmt: skip
        assert len(answers) >= 2, row["extra_info"]  # a constant answer passes no problem
        prompt = row["prompt"][0]["content"]
        assert "```python" in prompt
        assert "For example" in prompt


def test_independent_solutions_pass_every_problem_of_their_template() -> None:
    reward = CodeReward(CodeRewardConfig(test_timeout_s=2.0), call_limit_s=60.0)
    checked = Counter()
    for row in TRAIN + TEST:
        info = row["extra_info"]
        if info["template"] not in SOLUTIONS or checked[info["template"]] >= 3:
            continue
        program = SOLUTIONS[info["template"]].format(k=info["k"])
        response = f"```python\n{program}\n```"
        assert reward(response, row["reward_model"]["ground_truth"]) == 1.0, (info, program)
        if "{k}" in SOLUTIONS[info["template"]]:  # off by one in k: the tests tell
            wrong = SOLUTIONS[info["template"]].format(k=info["k"] + 1)
            assert reward(f"```python\n{wrong}\n```", row["reward_model"]["ground_truth"]) == 0.0
        checked[info["template"]] += 1
    assert set(checked) == set(SOLUTIONS)
