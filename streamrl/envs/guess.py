"""The `guess` environment: multi-turn arithmetic without tools. After a wrong answer the
environment says whether the right one is higher or lower and asks again; the episode ends on
a right answer or after `max_guesses` answers.

The answer read from a turn is the last `\\boxed{...}` number, else the last number in it; it
is right when it equals the ground truth (compared exactly as fractions, so `12`, `12.0` and
`24/2` are all 12). A number longer than `MAX_NUMBER_CHARS` characters is not read as one, and
reading a turn takes time linear in its length, whatever the policy wrote. Score: 1 for a right
first answer, halved for every further guess it took (0.5, 0.25, ...), 0 if none was right;
each turn's reward (1 right, 0 wrong) is recorded.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, ClassVar

from streamrl.envs.base import Environment, Reset, Step, Task

__all__ = ["MAX_NUMBER_CHARS", "GuessEnv", "read_number"]

MAX_NUMBER_CHARS = 64
"""Longest number read from a turn, in characters (commas left out): longer digit runs are a
degenerate policy's, not an answer, and a bounded number is cheap to compare and to show."""

_BOX = "\\boxed{"
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")  # no nested repetition: linear


def read_number(text: str) -> Fraction | None:
    """The answer a turn gives: the last boxed number, else the last number; None if none."""
    boxed = [content.strip().replace(",", "") for content in _boxed(text)]
    numbers = [n for n in boxed if len(n) <= MAX_NUMBER_CHARS and _NUMBER.fullmatch(n)] or [
        n for n in _NUMBER.findall(text.replace(",", "")) if len(n) <= MAX_NUMBER_CHARS
    ]
    if not numbers:
        return None
    try:
        return Fraction(numbers[-1])
    except (ValueError, ZeroDivisionError):  # "1.5/3", "1/0": no number
        return None


def _boxed(text: str) -> list[str]:
    """The contents of every `\\boxed{...}` holding no brace, in one pass over `text`: each
    search starts where the last stopped, and a closing brace found is reused by every box
    opened before it."""
    contents: list[str] = []
    start, close = 0, -1
    while (start := text.find(_BOX, start)) >= 0:
        start += len(_BOX)
        if close < start:
            close = text.find("}", start)
            if close < 0:
                break
        if text.find("{", start, close) < 0:
            contents.append(text[start:close])
    return contents


class GuessEnv(Environment):
    """Arithmetic with "higher / lower" hints after a wrong answer (module docstring). State:
    {"guesses": n, "solved": bool}."""

    max_guesses: ClassVar[int] = 4

    def reset(self, task: Task) -> Reset:
        read_target(task)  # a ground truth that is no number is a data error: fail here
        return Reset(list(task.messages), {"guesses": 0, "solved": False})

    def step(self, task: Task, state: Any, text: str) -> Step:
        target = read_target(task)
        guesses = state["guesses"] + 1
        guess = read_number(text)
        if guess == target:
            return Step(state={"guesses": guesses, "solved": True}, done=True, reward=1.0)
        state = {"guesses": guesses, "solved": False}
        if guesses >= self.max_guesses:
            return Step(state=state, done=True, reward=0.0)
        if guess is None:
            hint = (
                f"I could not find a number (of at most {MAX_NUMBER_CHARS} characters) in your "
                "answer."
            )
        else:
            hint = f"{_shown(guess)} is too {'low' if guess < target else 'high'}."
        left = self.max_guesses - guesses
        message = (
            f"{hint} Try again ({left} {'guess' if left == 1 else 'guesses'} left); put the "
            "final answer, a single number, in \\boxed{}."
        )
        return Step([{"role": "user", "content": message}], state, reward=0.0)

    def score(self, task: Task, state: Any, final: str) -> float:
        return 0.5 ** (state["guesses"] - 1) if state["solved"] else 0.0


def read_target(task: Task) -> Fraction:
    """The task's ground truth, which must be a number ("12", "-3", "2.5", "5/6")."""
    truth = task.ground_truth.strip().replace(",", "")
    target = Fraction(truth) if _NUMBER.fullmatch(truth) else None
    if target is None:
        raise ValueError(
            f"the guess environment needs a number as ground truth, got {task.ground_truth!r}"
        )
    return target


def _shown(value: Fraction) -> str:
    """A guess for the hint: an integer as it is, else a decimal. A guess is at most
    `MAX_NUMBER_CHARS` long (`read_number`), so neither overflows."""
    return str(value.numerator) if value.denominator == 1 else str(float(value))
