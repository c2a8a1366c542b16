"""Math rewards: is the final answer right (`math_reward`), is it stated in the expected form
(`format_reward`), or both (`math_format_reward`).

Correctness is decided by HuggingFace's `math-verify`: it extracts the final answer of a
response — the last `\\boxed{...}`, "the final answer is X", "Answer: X", a LaTeX expression,
or as a last resort the last number — parses it into SymPy and compares it with the parsed
ground truth, so `0.5`, `1/2` and `\\frac{1}{2}` are the same answer, `1,000` is `1000`,
`x^2 + 1` is `1 + x^2` and units such as `5 cm` are dropped.

Departure from math-verify's defaults: its own time limits (`parsing_timeout`,
`timeout_seconds`) are off. They work through SIGALRM, which exists only in a process's main
thread and would hijack the caller's alarm; `streamrl.rewards.scoring.RewardScorer` instead
runs every call in a worker process and kills the worker when `reward.timeout_s` passes. Call
these functions directly only with trusted, short inputs.

Ground truths are taken as LaTeX without delimiters (the DAPO-Math-17k / verl layout: `34`,
`\\frac{\\pi}{2}`, `(1, 2)`) and parsed as if boxed; one that already contains `$` or `\\boxed`
is parsed as written. A ground truth math-verify cannot parse is a data error and raises.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

__all__ = [
    "format_reward",
    "load_math_verify",
    "math_format_reward",
    "math_reward",
    "parse_ground_truth",
]


@functools.cache
def load_math_verify() -> tuple[Any, tuple[Any, ...]]:
    """math-verify and its extraction order: LaTeX (boxed, "final answer is", "Answer:",
    $...$) first, then plain numbers/expressions. Imported on first use (it loads SymPy), so
    importing the rewards package costs nothing where no reward is computed (the learner)."""
    import math_verify

    extraction = (math_verify.LatexExtractionConfig(), math_verify.ExprExtractionConfig())
    return math_verify, extraction


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns once per process that its (signal-based) timeout is off. Off is our
    deliberate choice — the scorer's worker processes enforce the limit — so the warning, which
    every fresh worker would print, carries no information here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


# --------------------------------------------------------------------------------------------
# Correctness
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _parse_ground_truth_cached(ground_truth: str) -> tuple[Any, ...]:
    text = ground_truth.strip()
    if "$" not in text and "\\boxed" not in text:
        text = f"\\boxed{{{text}}}"
    math_verify, extraction = load_math_verify()
    return tuple(math_verify.parse(text, extraction_config=extraction, parsing_timeout=None))


def parse_ground_truth(ground_truth: str) -> list[Any]:
    """The ground truth parsed by math-verify (SymPy objects, then its string form).

    Cached: the G responses of a group share one ground truth.

    Raises:
        ValueError: math-verify extracts nothing from it; the dataset's answer field holds
            something other than a math answer.
    """
    parsed = _parse_ground_truth_cached(ground_truth)
    if not parsed:
        raise ValueError(
            f"ground truth {ground_truth!r} is not a math answer math-verify can parse; check "
            "data.answer_field points at the final answer (e.g. '34' or '\\frac{1}{2}'), or "
            "use a reward that fits this dataset"
        )
    return list(parsed)


def math_reward(response: str, ground_truth: str, *, prompt: str | None = None) -> float:
    """1.0 when the response's final answer equals the ground truth mathematically, else 0.0.

    A response with no extractable answer scores 0.0. `prompt` is unused.
    """
    del prompt
    gold = parse_ground_truth(ground_truth)
    math_verify, extraction = load_math_verify()
    answer = math_verify.parse(response, extraction_config=extraction, parsing_timeout=None)
    if not answer:
        return 0.0
    return 1.0 if math_verify.verify(gold, answer, timeout_seconds=None) else 0.0


# --------------------------------------------------------------------------------------------
# Form
# --------------------------------------------------------------------------------------------

_BOXED = re.compile(r"\\boxed(?![A-Za-z])")
# A line holding the final answer: "Answer: 12", "Final answer: 12", "**Answer:** 12",
# "**Answer**: 12" (case-insensitive); the answer must follow on the same line.
_ANSWER_LINE = re.compile(
    r"^[ \t]*(?:\*\*)?(?:final[ \t]+)?answer(?:\*\*)?[ \t]*:(?:\*\*)?[ \t]*(?P<answer>.*?)[ \t]*$",
    re.IGNORECASE | re.MULTILINE,
)


def _boxed_content(text: str, start: int) -> str | None:
    """The argument of the `\\boxed` ending at `start`, or None when it is not a brace group
    with balanced braces (escaped `\\{`, `\\}` do not count)."""
    i = start
    while i < len(text) and text[i] in " \t":
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    depth, j = 0, i
    while j < len(text):
        char = text[j]
        if char == "\\":
            j += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
        j += 1
    return None


def format_reward(response: str, ground_truth: str, *, prompt: str | None = None) -> float:
    """1.0 when the response states exactly one final answer in a recognised form, else 0.0.

    What is checked (the answer's value is not: `ground_truth` and `prompt` are unused):

    * With `\\boxed`: it occurs exactly once, is followed by a brace group whose braces
      balance, the group is not blank, and at most one "Answer:" line exists (which may hold
      the box: "Answer: \\boxed{12}").
    * Without `\\boxed`: exactly one line of the form "Answer: X" ("Final answer:",
      "**Answer:**" and any letter case also count) with a non-blank X on that same line.

    Everything else — no answer, two boxes, `\\boxed 5` without braces, an unclosed box, two
    "Answer:" lines, "Answer:" with the value on the next line — scores 0.0.
    """
    del ground_truth, prompt
    boxes = list(_BOXED.finditer(response))
    answer_lines = [m.group("answer") for m in _ANSWER_LINE.finditer(response)]
    if len(boxes) > 1 or len(answer_lines) > 1:
        return 0.0
    if boxes:
        content = _boxed_content(response, boxes[0].end())
        return 1.0 if content is not None and content.strip() else 0.0
    return 1.0 if answer_lines and answer_lines[0] else 0.0


def math_format_reward(response: str, ground_truth: str, *, prompt: str | None = None) -> float:
    """1.0 when the answer is correct (`math_reward`) and well formed (`format_reward`), else
    0.0: a stricter verifier that also teaches the model to state one final answer."""
    if not format_reward(response, ground_truth, prompt=prompt):
        return 0.0
    return math_reward(response, ground_truth, prompt=prompt)
