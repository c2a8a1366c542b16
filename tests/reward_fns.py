"""User reward functions for the reward tests, resolved by import path ('tests.reward_fns:...')
in the test process and again in the scorer's spawned workers."""

from __future__ import annotations

import os
import time

NOT_CALLABLE = 42


def scripted(response: str, ground_truth: str, *, prompt: str | None = None) -> object:
    """Does what the response says, else exact match of response and ground truth:

    'hang' sleeps 100 s; 'sleep:S' sleeps S seconds first; 'raise' raises ValueError('boom');
    'crash' ends its process at once; 'return:X' returns X (1.5, -1, nan, text, none, true);
    'prompt' scores 1.0 when the prompt equals the ground truth.
    """
    if response == "hang":
        time.sleep(100)
    if response.startswith("sleep:"):
        time.sleep(float(response.removeprefix("sleep:")))
    if response == "raise":
        raise ValueError("boom")
    if response == "crash":
        os._exit(3)
    if response.startswith("return:"):
        values = {"1.5": 1.5, "-1": -1, "nan": float("nan"), "text": "yes", "none": None}
        return values.get(response.removeprefix("return:"), True)
    if response == "prompt":
        return prompt == ground_truth
    return response == ground_truth


def without_prompt(response: str, ground_truth: str) -> float:
    """A reward that does not take the `prompt` keyword."""
    return float(response.strip() == ground_truth.strip())


def one_argument(response: str) -> float:
    """Not a reward: it cannot take a ground truth."""
    return 1.0


def hang_once_raise_once(response: str, ground_truth: str, *, prompt: str | None = None) -> float:
    """Hangs on its first call and raises on its second, across all worker processes (marker
    files under $STREAMRL_TEST_MARKERS); afterwards scores 0."""
    folder = os.environ["STREAMRL_TEST_MARKERS"]
    for name, action in (("hung", "hang"), ("raised", "raise")):
        try:
            with open(os.path.join(folder, name), "x"):
                pass
        except FileExistsError:
            continue
        if action == "hang":
            time.sleep(100)
        raise ValueError("boom")
    return 0.0


def contains_seven(response: str, ground_truth: str, *, prompt: str | None = None) -> float:
    """A task a random-init tiny model can learn in a few CPU minutes: 1 when the response
    contains the digit 7 (under a tenth of its random responses do at first)."""
    return float("7" in response)


def raises_on_odd_answer(response: str, ground_truth: str, *, prompt: str | None = None) -> float:
    """Raises for an odd integer ground truth (about half the arithmetic prompts, every response
    of their groups), else 1 for an exact answer: groups whose reward calls fail are told apart
    from their ground truth alone."""
    if int(ground_truth) % 2:
        raise ValueError(f"no verifier for odd answers ({ground_truth})")
    return float(response.strip() == ground_truth.strip())


def always_raises(response: str, ground_truth: str, *, prompt: str | None = None) -> float:
    """A broken reward: raises on every call."""
    raise ValueError("this reward function is broken")
