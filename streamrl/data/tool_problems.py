"""Bundled problems for the calculator agent, and demonstrations of the tool in use.

`builtin:calculator` / `builtin:calculator-test`: arithmetic too large to do reliably in a small
model's head, worded as `builtin:arithmetic` is (half short word problems, half direct
questions), in the verl layout the math reward reads. Half the problems take one operation —
two-digit times two-digit, three-digit plus three-digit, three-digit minus two-digit — and
their word problems end by restating the sum; the other half take two (A × B + C, A × B − C,
A + B − C), and their word problems leave the sum to the reader. The test split is held out by
construction: a problem is in it exactly when a hash of its expression says so, so no training
problem asks a test fact. Each row's `extra_info` has the `expression` the calculator
evaluates and the number of `operations`.

`builtin:calculator-demos` / `builtin:calculator-demos-test`: one conversation per one-operation
problem of the matching split (the first `DEMOS` / `DEMOS_TEST`), in the OpenAI chat layout a
supervised run reads (`streamrl.learner.supervised`): the problem, the assistant's call
`calculate(expression="A op B")` (`streamrl.envs.calculator`), the tool's answer as the
calculator gives it, and the final answer restating the sum with the result in `\\boxed{}`.
The tools are the calculator environment's own (`sft.tools=environment`), so a demonstration
renders exactly as an RL episode of the same problem begins. The demonstrations never show a
two-operation problem: the warm start teaches the format and the tool, and RL on
`builtin:calculator` meets problems it has to compose into one expression (or two calls).

`builtin:calculator-answers` / `builtin:calculator-answers-test`: the same one-operation
problems answered without a tool — the problem, then at once the final answer as the
demonstrations give it. The recipe without the tool (single-turn) warm-starts on these, for
comparison with the agent.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import Any

__all__ = [
    "calculator_answer_rows",
    "calculator_answer_test_rows",
    "calculator_demo_rows",
    "calculator_demo_test_rows",
    "calculator_rows",
    "calculator_test_rows",
]

SIZE = 2000
TEST_SIZE = 256
DEMOS = 768
DEMOS_TEST = 64
TEST_SHARE = 0.2  # of the possible problems, held out
TWO_OPERATIONS_SHARE = 0.5
INSTRUCTION = "Put the final answer, a single number, in \\boxed{}."

TWO_DIGITS, THREE_DIGITS = (10, 99), (100, 999)
_OPERANDS = {  # the form's operands' ranges, in order
    "a * b": (TWO_DIGITS, TWO_DIGITS),
    "a + b": (THREE_DIGITS, THREE_DIGITS),
    "a - b": (THREE_DIGITS, TWO_DIGITS),
    "a * b + c": (TWO_DIGITS, TWO_DIGITS, TWO_DIGITS),
    "a * b - c": (TWO_DIGITS, TWO_DIGITS, TWO_DIGITS),
    "a + b - c": (THREE_DIGITS, THREE_DIGITS, TWO_DIGITS),
}
_ANSWER: dict[str, Callable[..., int]] = {
    "a * b": lambda a, b: a * b,
    "a + b": lambda a, b: a + b,
    "a - b": lambda a, b: a - b,
    "a * b + c": lambda a, b, c: a * b + c,
    "a * b - c": lambda a, b, c: a * b - c,
    "a + b - c": lambda a, b, c: a + b - c,
}
_WORDED = {
    "a * b": (
        "A warehouse has {a} crates with {b} bottles in each crate. How many bottles are there?",
        "{name} plants {a} rows of trees with {b} trees in each row. How many trees are planted?",
    ),
    "a + b": (
        "A library had {a} books and bought {b} more. How many books does it have now?",
        "{name} walked {a} steps before lunch and {b} steps after. How many steps in all?",
    ),
    "a - b": (
        "A tank holds {a} litres and {b} litres are drained. How many litres are left?",
        "{name} had {a} points and lost {b}. How many points does {name} have now?",
    ),
    "a * b + c": (
        "A farm has {a} pens with {b} sheep in each pen, and {c} more sheep in the field. "
        "How many sheep does the farm have?",
        "{name} buys {a} packs of {b} stickers and is given {c} stickers more. How many "
        "stickers does {name} have?",
    ),
    "a * b - c": (
        "A warehouse has {a} crates with {b} bottles in each crate, and {c} of the bottles "
        "are broken. How many bottles are not broken?",
        "{name} prints {a} pages a day for {b} days and throws {c} of them away. How many "
        "pages are kept?",
    ),
    "a + b - c": (
        "A library had {a} books, bought {b} more and gave {c} away. How many books does it "
        "have now?",
        "{name} saved {a} coins, earned {b} more and spent {c}. How many coins are left?",
    ),
}
_NAMES = ("Ava", "Ben", "Chloe", "Dan", "Emma", "Finn", "Grace", "Hugo")


def held_out(expression: str) -> bool:
    """Whether the problem of `expression` belongs to the test split (a fixed hash, not a draw)."""
    digest = hashlib.sha256(f"streamrl-calculator:{expression}".encode()).digest()
    return digest[0] < 256 * TEST_SHARE


def _problems(seed: str, size: int, test: bool) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    source = "builtin:calculator-test" if test else "builtin:calculator"
    rows: list[dict[str, Any]] = []
    while len(rows) < size:
        two = rng.random() < TWO_OPERATIONS_SHARE
        form = rng.choice([f for f, operands in _OPERANDS.items() if (len(operands) == 3) == two])
        bounds = _OPERANDS[form]
        values = {name: rng.randint(*b) for name, b in zip("abc", bounds, strict=False)}
        expression = " ".join(str(values.get(part, part)) for part in form.split())
        if held_out(expression) != test:
            continue
        shown = expression.replace("*", "×")
        if rng.random() < 0.5:
            story = rng.choice(_WORDED[form]).format(name=rng.choice(_NAMES), **values)
            question = story if two else f"{story} That is, what is {shown}?"
        else:
            question = f"What is {shown}?"
        rows.append({
            "prompt": [{"role": "user", "content": f"{question}\n{INSTRUCTION}"}],
            "reward_model": {"ground_truth": str(_ANSWER[form](**values)), "style": "rule"},
            "data_source": source,
            "extra_info": {"index": len(rows), "expression": expression,
                           "operations": 2 if two else 1},
        })  # fmt: skip
    return rows


def calculator_rows() -> list[dict[str, Any]]:
    """The training problems (`SIZE`), never a held-out one."""
    return _problems("streamrl-calculator-v2", SIZE, test=False)


def calculator_test_rows() -> list[dict[str, Any]]:
    """The held-out problems (`TEST_SIZE`)."""
    return _problems("streamrl-calculator-test-v2", TEST_SIZE, test=True)


def _one_operation(rows: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    return [row for row in rows if row["extra_info"]["operations"] == 1][:count]


def demonstration(row: dict[str, Any]) -> dict[str, Any]:
    """The conversation of one problem solved with the calculator (module docstring)."""
    expression = row["extra_info"]["expression"]
    result = row["reward_model"]["ground_truth"]  # what calculate(expression) answers (tested)
    call = {"type": "function", "function": {"name": "calculate",
                                             "arguments": {"expression": expression}}}  # fmt: skip
    shown = expression.replace("*", "×")
    return {
        "messages": [
            *row["prompt"],
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculate", "content": result},
            {"role": "assistant", "content": f"{shown} = {result}, so the answer is "
                                             f"\\boxed{{{result}}}."},
        ],
        "data_source": row["data_source"].replace("calculator", "calculator-demos"),
        "extra_info": row["extra_info"],
    }  # fmt: skip


def direct_answer(row: dict[str, Any]) -> dict[str, Any]:
    """The conversation of one problem answered without the calculator: the demonstration's
    final answer, at once."""
    demo = demonstration(row)
    return {
        "messages": [*row["prompt"], demo["messages"][-1]],
        "data_source": row["data_source"].replace("calculator", "calculator-answers"),
        "extra_info": demo["extra_info"],
    }


def calculator_demo_rows() -> list[dict[str, Any]]:
    """Demonstrations on the first `DEMOS` training problems."""
    return [demonstration(row) for row in _one_operation(calculator_rows(), DEMOS)]


def calculator_demo_test_rows() -> list[dict[str, Any]]:
    """Demonstrations on the first `DEMOS_TEST` held-out problems (the held-out loss)."""
    return [demonstration(row) for row in _one_operation(calculator_test_rows(), DEMOS_TEST)]


def calculator_answer_rows() -> list[dict[str, Any]]:
    """Direct answers to the problems the demonstrations solve with the tool."""
    return [direct_answer(row) for row in _one_operation(calculator_rows(), DEMOS)]


def calculator_answer_test_rows() -> list[dict[str, Any]]:
    """Direct answers to the held-out problems of `calculator_demo_test_rows`."""
    return [direct_answer(row) for row in _one_operation(calculator_test_rows(), DEMOS_TEST)]
