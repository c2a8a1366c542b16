"""The `guess` environment: multi-turn arithmetic without tools. After a wrong answer the
environment says whether the right one is higher or lower and asks again; the episode ends on
a right answer or after `max_guesses` answers.

The answer read from a turn is the last `\\boxed{...}` number, else the last number in it; it
is right when it equals the ground truth (compared exactly as fractions, so `12`, `12.0` and
`24/2` are all 12). Score: 1 for a right first answer, halved for every further guess it took
(0.5, 0.25, ...), 0 if none was right; each turn's reward (1 right, 0 wrong) is recorded.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, ClassVar

from streamrl.envs.base import Environment, Reset, Step, Task

__all__ = ["GuessEnv", "read_number"]

_BOXED = re.compile(r"\\boxed\{\s*([^{}]*?)\s*\}")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def read_number(text: str) -> Fraction | None:
    """The answer a turn gives: the last boxed number, else the last number; None if none."""
    boxed = [m for m in _BOXED.findall(text) if _NUMBER.fullmatch(m.replace(",", ""))]
    candidates = boxed or _NUMBER.findall(text.replace(",", ""))
    if not candidates:
        return None
    try:
        return Fraction(candidates[-1].replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


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
            hint = "I could not find a number in your answer."
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
    return str(value.numerator) if value.denominator == 1 else str(float(value))
