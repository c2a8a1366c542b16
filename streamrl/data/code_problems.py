"""The bundled code problems, `builtin:code` and its held-out split `builtin:code-test`: small
Python tasks of graded difficulty — functions over numbers, strings and lists, and programs
that read standard input — each with one public test (shown in the prompt as the example) and
several hidden ones, every expected output computed by a reference solution here.

Problems come from templates with a parameter (`times_k` with K = 7: "return x multiplied by
7"). Each template's parameters are split, not sampled: every fifth value is held out, so the
test split asks problems no training row asks, in the same wording (a problem is its prompt;
tests/unit/data/test_code_problems.py checks the splits share none).

The prompt states the task, the public test as an example, and the answer's form — a
```python block with the function's signature (measured: the demo model, SmolLM2-135M-Instruct,
passes ~25% of level-1 problems when shown the form and none when only asked for a code block,
which it mostly writes without its fences; benchmarks/RESULTS.md).

Rows use verl's layout with LiveCodeBench's tests in the ground truth, which the `code` reward
reads with its default settings (`generator.reward.code.layout: auto`):

    {"prompt": [{"role": "user", "content": ...}],
     "reward_model": {"ground_truth": "{\\"public_test_cases\\": ..., \\"private_test_cases\\":
                      ..., \\"metadata\\": {\\"func_name\\": ...}}", "style": "code"},
     "data_source": "builtin:code", "extra_info": {"index": 0, "template": ..., "level": 1}}

Levels: 1 (one arithmetic or string operation), 2 (a loop or a condition), 3 (an algorithm:
primes, gcd, run-length encoding, ...).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["CODE_INSTRUCTION", "code_rows", "code_test_rows"]

CODE_INSTRUCTION = "Reply with the code only, in this form:"
HIDDEN_TESTS = 5
_HOLD_OUT_EVERY = 5


@dataclass(frozen=True)
class _Template:
    """A family of problems: `text(k)` states the task for parameter k, `solve(k, *args)` is
    the reference, `args(k, rng)` draws one test's arguments; `stdin` problems read their
    arguments as one line of standard input and print the result."""

    name: str
    level: int
    signature: str
    text: Callable[[int], str]
    solve: Callable[..., Any]
    args: Callable[[int, random.Random], tuple[Any, ...]]
    params: Sequence[int]
    stdin: bool = False


def _ints(low: int, high: int, count: int = 1) -> Callable[[int, random.Random], tuple[int, ...]]:
    return lambda k, rng: tuple(rng.randint(low, high) for _ in range(count))


def _int_list(low: int, high: int) -> Callable[[int, random.Random], tuple[list[int]]]:
    return lambda k, rng: ([rng.randint(low, high) for _ in range(rng.randint(1, 8))],)


_WORDS = ("apple", "banana", "level", "kayak", "stream", "python", "rotor", "queue", "civic",
          "letter", "data", "noon", "model", "reward", "radar", "token", "tests",
          "hello")  # fmt: skip


def _word(k: int, rng: random.Random) -> tuple[str]:
    return (rng.choice(_WORDS),)


def _letters(k: int, rng: random.Random) -> str:
    """A short string over the letter k and three others: it occurs 0 to several times."""
    alphabet = [_LETTERS[k], *rng.sample([c for c in _LETTERS if c != _LETTERS[k]], 3)]
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(3, 10)))


def _with_common_factor(k: int, rng: random.Random) -> tuple[int, int]:
    factor = rng.randint(1, 12)
    return factor * rng.randint(1, 25), factor * rng.randint(1, 25)


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1))


def _run_length(s: str) -> str:
    out, i = [], 0
    while i < len(s):
        j = i
        while j < len(s) and s[j] == s[i]:
            j += 1
        out.append(f"{s[i]}{j - i}")
        i = j
    return "".join(out)


_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_TEMPLATES: tuple[_Template, ...] = (
    _Template("add_k", 1, "add_k(x)", lambda k: f"returns `x` plus {k}",
              lambda k, x: x + k, _ints(-50, 50), range(1, 41)),
    _Template("times_k", 1, "times_k(x)", lambda k: f"returns `x` multiplied by {k}",
              lambda k, x: x * k, _ints(-20, 20), range(2, 32)),
    _Template("minus_k", 1, "minus_k(x)", lambda k: f"returns `x` minus {k}",
              lambda k, x: x - k, _ints(-50, 50), range(1, 26)),
    _Template("power_k", 1, "power_k(x)", lambda k: f"returns `x` raised to the power {k}",
              lambda k, x: x**k, _ints(-6, 6), range(2, 7)),
    _Template("divisible_by_k", 1, "divisible_by_k(n)",
              lambda k: f"returns True if `n` is divisible by {k}, else False",
              lambda k, n: n % k == 0, lambda k, rng: (k * rng.randint(0, 9) + rng.randint(0, 1),),
              range(2, 17)),
    _Template("repeat_k", 1, "repeat_k(s)",
              lambda k: f"returns the string `s` repeated {k} times",
              lambda k, s: s * k, _word, range(2, 7)),
    _Template("count_letter", 2, "count_letter(s)",
              lambda k: f"returns how many times the letter '{_LETTERS[k]}' occurs in the "
              "string `s`",
              lambda k, s: s.count(_LETTERS[k]), lambda k, rng: (_letters(k, rng),), range(0, 26)),
    _Template("clamp_k", 2, "clamp_k(x)",
              lambda k: f"returns `x` if it is at most {k}, and {k} otherwise",
              lambda k, x: min(x, k), _ints(-30, 30), range(-10, 16)),
    _Template("sum_times_k", 2, "sum_times_k(xs)",
              lambda k: f"returns the sum of the list of integers `xs`, multiplied by {k}",
              lambda k, xs: sum(xs) * k, _int_list(-9, 9), range(1, 21)),
    _Template("count_above_k", 2, "count_above_k(xs)",
              lambda k: f"returns how many numbers in the list `xs` are greater than {k}",
              lambda k, xs: sum(x > k for x in xs), _int_list(-10, 10), range(-5, 8)),
    _Template("keep_multiples", 2, "keep_multiples(xs)",
              lambda k: f"returns a list of the numbers in `xs` that are multiples of {k}, in "
              "order",
              lambda k, xs: [x for x in xs if x % k == 0], _int_list(0, 40), range(2, 12)),
    _Template("digit_sum_times_k", 2, "digit_sum_times_k(n)",
              lambda k: f"returns the sum of the decimal digits of the non-negative integer `n`, "
              f"multiplied by {k}",
              lambda k, n: sum(map(int, str(n))) * k, _ints(0, 99999), range(1, 11)),
    _Template("fizz_k", 2, "fizz_k(n)",
              lambda k: f"returns the string 'Fizz' if `n` is divisible by {k}, and otherwise "
              "`n` as a string",
              lambda k, n: "Fizz" if n % k == 0 else str(n), _ints(1, 60), range(2, 12)),
    _Template("nth_prime_after_k", 3, "next_prime(n)",
              lambda k: f"returns the smallest prime number greater than `n` + {k}",
              lambda k, n: next(p for p in range(n + k + 1, 10**6) if _is_prime(p)),
              _ints(0, 200), range(0, 11)),
    _Template("gcd_plus_k", 3, "gcd_plus_k(a, b)",
              lambda k: f"returns the greatest common divisor of the positive integers `a` and "
              f"`b`, plus {k}",
              lambda k, a, b: math.gcd(a, b) + k, _with_common_factor, range(0, 11)),
    _Template("run_length", 3, "run_length(s)",
              lambda k: "returns the run-length encoding of the string `s`: each run of one "
              "letter as the letter and the run's length ('aab' gives 'a2b1')",
              lambda k, s: _run_length(s), lambda k, rng: ("".join(
                  rng.choice("ab" if k % 2 else "abc") * rng.randint(1, 4)
                  for _ in range(rng.randint(1, 4))),), range(0, 6)),
    _Template("kth_largest", 3, "kth_largest(xs)",
              lambda k: f"returns the {k}-th largest number of the list `xs` (1-th is the "
              f"largest; `xs` has at least {k} numbers; repeated numbers count once each)",
              lambda k, xs: sorted(xs, reverse=True)[k - 1],
              lambda k, rng: ([rng.randint(-20, 20) for _ in range(rng.randint(k, k + 5))],),
              range(1, 6)),
    _Template("stdin_sum_k", 1, "", lambda k: f"reads two integers from one line of standard "
              f"input and prints their sum plus {k}",
              lambda k, a, b: a + b + k, _ints(-99, 99, 2), range(0, 21), stdin=True),
    _Template("stdin_product_k", 2, "", lambda k: f"reads integers separated by spaces from one "
              f"line of standard input and prints their product times {k}",
              lambda k, *xs: math.prod(xs) * k,
              lambda k, rng: tuple(rng.randint(-5, 5) for _ in range(rng.randint(1, 5))),
              range(1, 16), stdin=True),
    _Template("stdin_reverse_k", 2, "", lambda k: f"reads a word from standard input and prints "
              f"it reversed, {k} times on one line separated by single spaces",
              lambda k, s: " ".join([s[::-1]] * k), _word, range(1, 6), stdin=True),
)  # fmt: skip


def _problem(template: _Template, k: int) -> dict[str, Any]:
    """One problem: its prompt and its tests, the first public (the prompt's example)."""
    rng = random.Random(f"{template.name}:{k}")
    tests, seen = [], set()
    for _ in range(500):  # distinct arguments, and not every test the same answer
        args = template.args(k, rng)
        result = template.solve(k, *args)
        last = len(tests) == HIDDEN_TESTS
        if repr(args) in seen or (last and all(r == result for _, r in tests)):
            continue
        seen.add(repr(args))
        tests.append((args, result))
        if len(tests) == 1 + HIDDEN_TESTS:
            break
    if template.stdin:
        line = lambda args: " ".join(map(str, args))  # noqa: E731
        cases = [
            {"input": line(a) + "\n", "output": f"{r}\n", "testtype": "stdin"} for a, r in tests
        ]
        (args, result) = tests[0]
        task = f"Write a Python program that {template.text(k)}."
        example = f"For example, for the input `{line(args)}` it prints `{result}`."
        form = "```python\n...\n```"
        metadata: dict[str, Any] = {}
    else:
        name = template.signature.split("(")[0]
        cases = [{"input": "\n".join(json.dumps(x) for x in a), "output": json.dumps(r),
                  "testtype": "functional"} for a, r in tests]  # fmt: skip
        (args, result) = tests[0]
        call = f"{name}({', '.join(map(repr, args))})"
        task = f"Write a Python function `{template.signature}` that {template.text(k)}."
        example = f"For example, `{call}` returns `{result!r}`."
        form = f"```python\ndef {template.signature}:\n    ...\n```"
        metadata = {"func_name": name}
    truth = {"public_test_cases": cases[:1], "private_test_cases": cases[1:], "metadata": metadata}
    return {"prompt": f"{task}\n{example}\n{CODE_INSTRUCTION}\n{form}", "truth": truth}


def _rows(held_out: bool, source: str) -> list[dict[str, Any]]:
    rows = []
    for template in _TEMPLATES:
        for position, k in enumerate(template.params):
            if (position % _HOLD_OUT_EVERY == _HOLD_OUT_EVERY - 1) != held_out:
                continue
            problem = _problem(template, k)
            rows.append({
                "prompt": [{"role": "user", "content": problem["prompt"]}],
                "reward_model": {"ground_truth": json.dumps(problem["truth"]), "style": "code"},
                "data_source": source,
                "extra_info": {"index": len(rows), "template": template.name, "k": k,
                               "level": template.level},
            })  # fmt: skip
    random.Random(source).shuffle(rows)
    return rows


def code_rows() -> list[dict[str, Any]]:
    """The training split: four of every five parameters of each template."""
    return _rows(held_out=False, source="builtin:code")


def code_test_rows() -> list[dict[str, Any]]:
    """The held-out split: every fifth parameter of each template."""
    return _rows(held_out=True, source="builtin:code-test")
