"""Bundled problems for the calculator agent, and demonstrations of the tool in use.

`builtin:calculator` / `builtin:calculator-test`: arithmetic too large to do reliably in a small
model's head — two-digit times two-digit, three-digit plus three-digit, three-digit minus
two-digit — worded as `builtin:arithmetic` is (half short word problems that restate the sum,
half direct questions), in the verl layout the math reward reads. The test split is held out by
construction: a problem's operands are in the test split exactly when a hash of (op, a, b) says
so, so no training problem asks a test fact.

`builtin:calculator-demos` / `builtin:calculator-demos-test`: one conversation per problem of
the matching split (the first `DEMOS` / `DEMOS_TEST`), in the OpenAI chat layout a supervised
run reads (`streamrl.learner.supervised`): the problem, the assistant's call
`calculate(expression="A op B")` (`streamrl.envs.calculator`), the tool's answer as the
calculator gives it, and the final answer restating the sum with the result in `\\boxed{}`.
The tools are the calculator environment's own (`sft.tools=environment`), so a demonstration
renders exactly as an RL episode of the same problem begins.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

__all__ = [
    "calculator_demo_rows",
    "calculator_demo_test_rows",
    "calculator_rows",
    "calculator_test_rows",
]

SIZE = 2000
TEST_SIZE = 256
DEMOS = 1024
DEMOS_TEST = 64
TEST_SHARE = 0.2  # of the possible problems, held out
INSTRUCTION = "Put the final answer, a single number, in \\boxed{}."

_OPERANDS = {"*": ((10, 99), (10, 99)), "+": ((100, 999), (100, 999)), "-": ((100, 999), (10, 99))}
_SYMBOL = {"*": "×", "+": "+", "-": "-"}
_WORDED = {
    "*": (
        "A warehouse has {a} crates with {b} bottles in each crate. How many bottles are there?",
        "{name} plants {a} rows of trees with {b} trees in each row. How many trees are planted?",
    ),
    "+": (
        "A library had {a} books and bought {b} more. How many books does it have now?",
        "{name} walked {a} steps before lunch and {b} steps after. How many steps in all?",
    ),
    "-": (
        "A tank holds {a} litres and {b} litres are drained. How many litres are left?",
        "{name} had {a} points and lost {b}. How many points does {name} have now?",
    ),
}
_NAMES = ("Ava", "Ben", "Chloe", "Dan", "Emma", "Finn", "Grace", "Hugo")


def held_out(op: str, a: int, b: int) -> bool:
    """Whether the problem (op, a, b) belongs to the test split (a fixed hash, not a draw)."""
    digest = hashlib.sha256(f"streamrl-calculator:{op}:{a}:{b}".encode()).digest()
    return digest[0] < 256 * TEST_SHARE


def _problems(seed: str, size: int, test: bool) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    source = "builtin:calculator-test" if test else "builtin:calculator"
    rows: list[dict[str, Any]] = []
    while len(rows) < size:
        op = rng.choice("*+-")
        (a_low, a_high), (b_low, b_high) = _OPERANDS[op]
        a, b = rng.randint(a_low, a_high), rng.randint(b_low, b_high)
        if held_out(op, a, b) != test:
            continue
        answer = a * b if op == "*" else a + b if op == "+" else a - b
        if rng.random() < 0.5:
            story = rng.choice(_WORDED[op]).format(name=rng.choice(_NAMES), a=a, b=b)
            question = f"{story} That is, what is {a} {_SYMBOL[op]} {b}?"
        else:
            question = f"What is {a} {_SYMBOL[op]} {b}?"
        rows.append({
            "prompt": [{"role": "user", "content": f"{question}\n{INSTRUCTION}"}],
            "reward_model": {"ground_truth": str(answer), "style": "rule"},
            "data_source": source,
            "extra_info": {"index": len(rows), "a": a, "b": b, "op": op},
        })  # fmt: skip
    return rows


def calculator_rows() -> list[dict[str, Any]]:
    """The training problems (`SIZE`), never a held-out one."""
    return _problems("streamrl-calculator-v1", SIZE, test=False)


def calculator_test_rows() -> list[dict[str, Any]]:
    """The held-out problems (`TEST_SIZE`)."""
    return _problems("streamrl-calculator-test-v1", TEST_SIZE, test=True)


def demonstration(row: dict[str, Any]) -> dict[str, Any]:
    """The conversation of one problem solved with the calculator (module docstring)."""
    info = row["extra_info"]
    expression = f"{info['a']} {info['op']} {info['b']}"
    result = row["reward_model"]["ground_truth"]  # what calculate(expression) answers (tested)
    call = {"type": "function", "function": {"name": "calculate",
                                             "arguments": {"expression": expression}}}  # fmt: skip
    sum_text = f"{info['a']} {_SYMBOL[info['op']]} {info['b']}"
    return {
        "messages": [
            *row["prompt"],
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculate", "content": result},
            {"role": "assistant", "content": f"{sum_text} = {result}, so the answer is "
                                             f"\\boxed{{{result}}}."},
        ],
        "data_source": row["data_source"].replace("calculator", "calculator-demos"),
        "extra_info": info,
    }  # fmt: skip


def calculator_demo_rows() -> list[dict[str, Any]]:
    """Demonstrations on the first `DEMOS` training problems."""
    return [demonstration(row) for row in calculator_rows()[:DEMOS]]


def calculator_demo_test_rows() -> list[dict[str, Any]]:
    """Demonstrations on the first `DEMOS_TEST` held-out problems (the held-out loss)."""
    return [demonstration(row) for row in calculator_test_rows()[:DEMOS_TEST]]
