"""Datasets bundled with streamrl, so a run needs no download: `builtin:arithmetic` and its
held-out split `builtin:arithmetic-test`, `builtin:math`, the code problems `builtin:code` /
`builtin:code-test` (`streamrl.data.code_problems`), and the calculator agent's problems and
demonstrations `builtin:calculator[-test]`, `builtin:calculator-demos[-test]`,
`builtin:calculator-answers[-test]` (`streamrl.data.tool_problems`), and preference pairs over
the arithmetic problems, `builtin:arithmetic-pairs[-test]`, with their chosen answers as
conversations, `builtin:arithmetic-demos[-test]`.

`arithmetic-pairs` holds one pair per problem of `arithmetic` (`-test`: of `arithmetic-test`) in
TRL's conversational layout — `prompt` the problem's messages, `chosen` and `rejected` the
assistant's answers as text — plus `ground_truth`. Chosen: correct and brief, in the format the
prompt asks for ("3 × 4 = 12, so the answer is \\boxed{12}."); rejected: the same sentence with
a wrong result — the other operation's (3 + 4 = 7 for 3 × 4) or the right one off by one or two
—, chosen by a seeded generator, so a pair differs only where correctness does.
`arithmetic-demos` is the chosen answers as SFT conversations (`messages`).

Both produce rows in the verl / DAPO-Math-17k layout that `DataConfig`'s default field mapping
reads unchanged:

    {"prompt": [{"role": "user", "content": ...}],
     "reward_model": {"ground_truth": "12", "style": "rule"},
     "data_source": "builtin:arithmetic", "extra_info": {"index": 0, ...}}

`arithmetic` is calibrated for the CPU demo (docs/design.md: accuracy must start between ~0.2 and
~0.8 or the learner starves): single-digit (2–9) addition and multiplication. Half the problems
are short word problems that end by restating the sum ("... That is, what is 3 × 4?"), half are
direct questions ("What is 3 * 4?"). Measured with SmolLM2-135M-Instruct as prepared here
(vLLM CPU, T=1, 8 samples, 64 tokens, math-verify): word problems alone 8–13% right (too few
mixed groups), restated word problems ~17%, direct questions ~25%; the mix is ~22%, with
~85% of groups mixed (96 prompts). Every question ends with "what is A op B?" (op `+`, `*`
or `×`), and a word problem says "each" exactly when it multiplies. Answers are integer
strings; the prompt asks for `\\boxed{N}`, which the math reward (math-verify) parses, as it
does a bare final number.

`arithmetic-test` is held out by construction, not by sampling: a fixed quarter of the facts
(9 of the 36 unordered single-digit pairs per op, `HELD_OUT_FACTS`; 3 × 4 and 4 × 3 are one fact)
is asked only there. `arithmetic` is the pool of 2000 problems without them (1526 rows), so no
generator ever samples a held-out fact, in any wording; `arithmetic-test` is 256 problems over
those facts, worded the same way. A gain on it is a gain on facts never trained on.

`math` is a small hand-written set of problems with answers (integers, fractions, simple
expressions) checked in tests/unit/data/test_data.py against independent sympy computations.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from streamrl.data.code_problems import code_rows, code_test_rows
from streamrl.data.tool_problems import (
    calculator_answer_rows,
    calculator_answer_test_rows,
    calculator_demo_rows,
    calculator_demo_test_rows,
    calculator_rows,
    calculator_test_rows,
)

__all__ = ["BUILTIN_DATASETS", "HELD_OUT_FACTS", "builtin_rows", "fact_of"]

ARITHMETIC_SIZE = 2000
ARITHMETIC_SEED = "streamrl-arithmetic-v1"
ARITHMETIC_TEST_SIZE = 256
ARITHMETIC_TEST_SEED = "streamrl-arithmetic-test-v1"
ARITHMETIC_HELD_OUT_SEED = "streamrl-arithmetic-held-out-v1"
HELD_OUT_PER_OP = 9  # of the 36 unordered facts of each op
ARITHMETIC_INSTRUCTION = "Put the final answer, a single number, in \\boxed{}."
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

_NAMES = (
    "Ava", "Ben", "Chloe", "Dan", "Emma", "Finn", "Grace", "Hugo",
    "Iris", "Jack", "Kira", "Leo", "Maya", "Noah", "Olive", "Paul",
)  # fmt: skip
_OBJECTS = (
    "apples", "marbles", "stickers", "books", "pencils", "cookies",
    "shells", "coins", "stamps", "cards", "eggs", "flowers",
)  # fmt: skip
_ADDITION = (
    "{name} has {a} {obj} and finds {b} more. How many {obj} does {name} have now?",
    "There are {a} {obj} in a box and {b} {obj} on the table. How many {obj} are there in total?",
    "{name} picked {a} {obj} in the morning and {b} {obj} in the afternoon. "
    "How many {obj} did {name} pick altogether?",
    "A shelf holds {a} {obj}. {name} puts {b} more {obj} on it. How many {obj} are on the shelf?",
    "{name} had {a} {obj}. A friend gave {name} {b} {obj}. How many {obj} does {name} have?",
)
_MULTIPLICATION = (
    "{name} has {a} bags with {b} {obj} in each bag. How many {obj} does {name} have?",
    "There are {a} boxes and each box holds {b} {obj}. How many {obj} are there in total?",
    "{name} buys {a} packs of {obj}, each with {b} {obj}. How many {obj} does {name} buy?",
    "A classroom has {a} tables and each table has {b} {obj}. How many {obj} are in the classroom?",
    "{name} makes {a} piles of {obj} with {b} {obj} in each pile. How many {obj} are there?",
)


def _row(source: str, index: int, question: str, answer: str, **extra: Any) -> dict[str, Any]:
    return {
        "prompt": [{"role": "user", "content": question}],
        "reward_model": {"ground_truth": answer, "style": "rule"},
        "data_source": source,
        "extra_info": {"index": index, **extra},
    }


# Every unordered pair of operands (a ≤ b, both 2–9): 36 facts per op.
_OPERAND_PAIRS = tuple((a, b) for a in range(2, 10) for b in range(a, 10))


def _held_out_facts() -> frozenset[tuple[str, int, int]]:
    """(op, min, max) of the facts only the test split asks: a fixed quarter of each op's."""
    rng = random.Random(ARITHMETIC_HELD_OUT_SEED)
    return frozenset(
        (op, a, b) for op in "+*" for a, b in rng.sample(_OPERAND_PAIRS, HELD_OUT_PER_OP)
    )


HELD_OUT_FACTS = _held_out_facts()


def fact_of(row: dict[str, Any]) -> tuple[str, int, int]:
    """The fact an arithmetic row asks, commutative pairs as one: (op, min, max)."""
    info = row["extra_info"]
    return (info["op"], min(info["a"], info["b"]), max(info["a"], info["b"]))


def _arithmetic_row(
    rng: random.Random, source: str, index: int, a: int, b: int, op: str
) -> dict[str, Any]:
    if rng.random() < 0.5:
        template = rng.choice(_ADDITION if op == "+" else _MULTIPLICATION)
        story = template.format(name=rng.choice(_NAMES), obj=rng.choice(_OBJECTS), a=a, b=b)
        question = f"{story} That is, what is {a} {'+' if op == '+' else '×'} {b}?"
    else:
        question = f"What is {a} {op} {b}?"
    answer = a + b if op == "+" else a * b
    question = f"{question}\n{ARITHMETIC_INSTRUCTION}"
    return _row(source, index, question, str(answer), a=a, b=b, op=op)


def arithmetic_pool(size: int = ARITHMETIC_SIZE) -> list[dict[str, Any]]:
    """`size` problems over every fact, always the same ones: what both splits are cut from
    (and the tiny model's tokenizer is trained on)."""
    rng = random.Random(ARITHMETIC_SEED)  # str seeds hash with SHA-512: stable across Pythons
    rows = []
    for index in range(size):
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        op = rng.choice("+*")
        rows.append(_arithmetic_row(rng, "builtin:arithmetic", index, a, b, op))
    return rows


def arithmetic_rows(size: int | None = None) -> list[dict[str, Any]]:
    """The training split: the pool's problems whose fact is not held out (1526); the first
    `size` of them when given."""
    rows = [row for row in arithmetic_pool() if fact_of(row) not in HELD_OUT_FACTS]
    return rows[:size]


def arithmetic_test_rows(size: int = ARITHMETIC_TEST_SIZE) -> list[dict[str, Any]]:
    """The held-out split: `size` problems, each asking one of `HELD_OUT_FACTS` (in either
    order, worded as the training problems are), drawn with a seed of their own."""
    rng = random.Random(ARITHMETIC_TEST_SEED)
    facts = sorted(HELD_OUT_FACTS)
    rows = []
    for index in range(size):
        op, a, b = rng.choice(facts)
        if rng.random() < 0.5:
            a, b = b, a
        rows.append(_arithmetic_row(rng, "builtin:arithmetic-test", index, a, b, op))
    return rows


# (question, answer in LaTeX). Answers are verified independently in tests/unit/data/test_data.py.
MATH_PROBLEMS: tuple[tuple[str, str], ...] = (
    ("What is $\\frac{1}{2} + \\frac{1}{3}$?", "\\frac{5}{6}"),
    ("Compute $7 \\times 8 - 6$.", "50"),
    ("What is $15\\%$ of $80$?", "12"),
    ("Solve for $x$: $3x + 5 = 20$.", "5"),
    ("What is the least common multiple of $4$ and $6$?", "12"),
    ("What is the greatest common divisor of $18$ and $24$?", "6"),
    ("Simplify $\\frac{12}{18}$.", "\\frac{2}{3}"),
    ("A rectangle is $7$ cm long and $4$ cm wide. What is its area in square centimetres?", "28"),
    ("What is $2^{10}$?", "1024"),
    ("What is $\\sqrt{144}$?", "12"),
    ("Compute $\\frac{3}{4} \\times \\frac{8}{9}$.", "\\frac{2}{3}"),
    ("What is the sum of the first $10$ positive integers?", "55"),
    ("Solve for $y$: $\\frac{y}{4} = 7$.", "28"),
    ("A $20$-dollar shirt is sold at $25\\%$ off. What is the sale price in dollars?", "15"),
    ("What is the perimeter of a square with side length $9$?", "36"),
    ("Evaluate $(-3)^3$.", "-27"),
    ("What is $\\frac{5}{6} - \\frac{1}{4}$?", "\\frac{7}{12}"),
    ("Compute $1.5 \\times 4$.", "6"),
    ("If $f(x) = 2x^2 - 3$, what is $f(3)$?", "15"),
    ("What is the mean of $4, 8, 15, 16, 23$?", "\\frac{66}{5}"),
    ("How many minutes are there in $3.5$ hours?", "210"),
    ("Simplify $\\sqrt{50}$.", "5\\sqrt{2}"),
    ("What is the remainder when $100$ is divided by $7$?", "2"),
    ("Find the negative number $x$ with $x^2 = 49$.", "-7"),
    ("What is the product of the roots of $x^2 - 5x + 6 = 0$?", "6"),
    ("Two angles of a triangle are $50^\\circ$ and $60^\\circ$. Find the third in degrees.", "70"),
    ("Write $\\frac{2}{5}$ as a decimal.", "0.4"),
    ("Compute $3! + 4!$.", "30"),
    ("What is the slope of the line through $(1, 2)$ and $(3, 8)$?", "3"),
    ("Expand $(x + 2)(x + 3)$.", "x^2 + 5x + 6"),
    ("Simplify $2(x + 4) - 3x$.", "8 - x"),
    ("What is the area of a circle of radius $3$? Give your answer in terms of $\\pi$.", "9\\pi"),
    ("What is $\\frac{7}{8}$ of $64$?", "56"),
    ("How many prime numbers are less than $20$?", "8"),
    ("What is $10 - 4 \\div 2 + 3$?", "11"),
    ("Solve for $x$: $2(x - 3) = x + 4$.", "10"),
    ("What is $\\log_2 32$?", "5"),
    ("Write $0.75$ as a fraction in lowest terms.", "\\frac{3}{4}"),
    ("What is $\\frac{1}{3}$ of $\\frac{3}{7}$?", "\\frac{1}{7}"),
    ("Compute $\\frac{2}{3} \\div \\frac{4}{9}$.", "\\frac{3}{2}"),
)  # fmt: skip


def math_rows() -> list[dict[str, Any]]:
    """The hand-written problems of `MATH_PROBLEMS` as verl-layout rows."""
    return [
        _row("builtin:math", index, f"{question}\n{MATH_INSTRUCTION}", answer)
        for index, (question, answer) in enumerate(MATH_PROBLEMS)
    ]


# -- preference pairs over the arithmetic problems ---------------------------------------

PAIRS_SEED = "streamrl-arithmetic-pairs-v1"


def arithmetic_pair_rows() -> list[dict[str, Any]]:
    """One preference pair per training problem (module docstring)."""
    return _pairs(arithmetic_rows(), "train")


def arithmetic_pair_test_rows() -> list[dict[str, Any]]:
    """One preference pair per held-out problem."""
    return _pairs(arithmetic_test_rows(), "test")


def arithmetic_demo_rows() -> list[dict[str, Any]]:
    return [_demo(row) for row in arithmetic_pair_rows()]


def arithmetic_demo_test_rows() -> list[dict[str, Any]]:
    return [_demo(row) for row in arithmetic_pair_test_rows()]


def _demo(pair: dict[str, Any]) -> dict[str, Any]:
    """A pair's chosen answer as a conversation (`sft.messages_field` messages)."""
    return {"messages": [*pair["prompt"], {"role": "assistant", "content": pair["chosen"]}]}


def _pairs(rows: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    rng = random.Random(f"{PAIRS_SEED}:{split}")
    out = []
    for row in rows:
        info = row["extra_info"]
        a, b, op = info["a"], info["b"], info["op"]
        right = a + b if op == "+" else a * b
        shown = "+" if op == "+" else "×"
        other = a * b if op == "+" else a + b
        near = right + rng.choice((-2, -1, 1, 2))
        wrong = other if other != right and rng.random() < 0.5 else near
        out.append({
            "prompt": row["prompt"],
            "chosen": _answer(a, shown, b, right),
            "rejected": _answer(a, shown, b, wrong),
            "ground_truth": row["reward_model"]["ground_truth"],
        })  # fmt: skip
    return out


def _answer(a: int, op: str, b: int, result: int) -> str:
    return f"{a} {op} {b} = {result}, so the answer is \\boxed{{{result}}}."


BUILTIN_DATASETS: dict[str, Callable[[], list[dict[str, Any]]]] = {
    "arithmetic": arithmetic_rows,
    "arithmetic-test": arithmetic_test_rows,
    "math": math_rows,
    "code": code_rows,
    "code-test": code_test_rows,
    "calculator": calculator_rows,
    "calculator-test": calculator_test_rows,
    "calculator-demos": calculator_demo_rows,
    "calculator-demos-test": calculator_demo_test_rows,
    "calculator-answers": calculator_answer_rows,
    "calculator-answers-test": calculator_answer_test_rows,
    "arithmetic-pairs": arithmetic_pair_rows,
    "arithmetic-pairs-test": arithmetic_pair_test_rows,
    "arithmetic-demos": arithmetic_demo_rows,
    "arithmetic-demos-test": arithmetic_demo_test_rows,
}


def builtin_rows(name: str) -> list[dict[str, Any]]:
    """Rows of the bundled dataset `name` (without the `builtin:` prefix); KeyError if unknown."""
    return BUILTIN_DATASETS[name]()
