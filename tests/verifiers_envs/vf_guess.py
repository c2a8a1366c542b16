"""The `guess` game (`streamrl.envs.guess`) written as a verifiers `MultiTurnEnv`, its twin for
`benchmarks/verifiers_bench.py`: after a wrong answer the environment says whether the right one
is higher or lower, in the same words, and asks again; the rollout ends on a right answer
(a `@vf.stop` condition) or after `max_guesses` answers (`max_turns`). Reward: 1 for a right
first answer, halved for every further guess, 0 if none was right.

Self-contained (streamrl is not installed in the worker environment): the answer read from a
turn is the last `\\boxed{...}` number, else the last number, compared as a fraction; a number
longer than `MAX_NUMBER_CHARS` is not read, and reading takes time linear in the text.
"""

import re
from fractions import Fraction

import verifiers as vf
from datasets import Dataset

MAX_NUMBER_CHARS = 64
_NUMBER = r"-?\d+(?:\.\d+)?(?:/\d+)?"
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")  # a run stops at the next brace: linear
_NUMBERS = re.compile(_NUMBER)


def read_number(text: str) -> Fraction | None:
    """The answer a turn gives: the last boxed number, else the last number; None if none."""
    text = text.replace(",", "")
    boxed = [b.strip() for b in _BOXED.findall(text)]
    numbers = [b for b in boxed if len(b) <= MAX_NUMBER_CHARS and re.fullmatch(_NUMBER, b)] or [
        n for n in _NUMBERS.findall(text) if len(n) <= MAX_NUMBER_CHARS
    ]
    if not numbers:
        return None
    try:
        return Fraction(numbers[-1])
    except (ValueError, ZeroDivisionError):  # "1/0": no number
        return None


def _guesses(completion) -> list[Fraction | None]:
    return [read_number(m["content"] or "") for m in completion if m["role"] == "assistant"]


def _target(answer: str) -> Fraction:
    return Fraction(answer.strip().replace(",", ""))


def _shown(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else str(float(value))


class GuessEnv(vf.MultiTurnEnv):
    async def env_response(self, messages: vf.Messages, state: vf.State) -> vf.Messages:
        guesses = _guesses(messages[len(state["prompt"]) :])
        guess, left = guesses[-1], self.max_turns - len(guesses)
        if guess is None:
            hint = (
                f"I could not find a number (of at most {MAX_NUMBER_CHARS} characters) in your "
                "answer."
            )
        else:
            target = _target(state["answer"])
            hint = f"{_shown(guess)} is too {'low' if guess < target else 'high'}."
        message = (
            f"{hint} Try again ({left} {'guess' if left == 1 else 'guesses'} left); put the "
            "final answer, a single number, in \\boxed{}."
        )
        return [vf.UserMessage(content=message)]

    @vf.stop
    async def solved(self, state: vf.State) -> bool:
        trajectory = state.get("trajectory") or []
        if not trajectory:
            return False
        guesses = _guesses(trajectory[-1]["completion"])
        return bool(guesses) and guesses[-1] == _target(state["answer"])


async def guessed(completion, answer) -> float:
    """1 for a right first answer, halved for each further guess; 0 if none was right."""
    guesses = _guesses(completion)
    right = bool(guesses) and guesses[-1] == _target(answer)
    return 0.5 ** (len(guesses) - 1) if right else 0.0


def load_environment(max_guesses: int = 4):
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": "What is 3+4?"}], "answer": "7"}]
    )
    return GuessEnv(dataset=dataset, rubric=vf.Rubric(funcs=[guessed]), max_turns=max_guesses)
