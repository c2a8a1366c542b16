"""Bundled preference pairs for the demo model: `builtin:arithmetic-pairs` and its held-out
split `builtin:arithmetic-pairs-test`; and their chosen answers as supervised conversations,
`builtin:arithmetic-demos[-test]` (the warm start of the `sft-dpo-rl` recipe).

One pair per problem of `builtin:arithmetic` (`-test`: of `builtin:arithmetic-test`, whose facts
training never sees), in TRL's conversational layout — `prompt` the problem's chat messages,
`chosen` and `rejected` the assistant's answers as text — plus the problem's `ground_truth`:

- chosen: correct and brief, in the format the prompt asks for: "3 × 4 = 12, so the answer is
  \\boxed{12}.";
- rejected: the same sentence with a wrong result — the other operation's (3 + 4 = 7 for
  3 × 4), or the right one off by one or two —, chosen by a seeded generator, so a pair differs
  only where correctness does and a preference learned from them is one for the right number.
"""

from __future__ import annotations

import random
from typing import Any

__all__ = [
    "arithmetic_demo_rows",
    "arithmetic_demo_test_rows",
    "arithmetic_pair_rows",
    "arithmetic_pair_test_rows",
]

PAIRS_SEED = "streamrl-arithmetic-pairs-v1"


def arithmetic_pair_rows() -> list[dict[str, Any]]:
    from streamrl.data.builtin import arithmetic_rows

    return _pairs(arithmetic_rows(), "train")


def arithmetic_pair_test_rows() -> list[dict[str, Any]]:
    from streamrl.data.builtin import arithmetic_test_rows

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
