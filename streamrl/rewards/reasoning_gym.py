"""The `reasoning_gym` reward: a reasoning-gym task's own scorer (`score_answer`) on the answer
the response gives.

The ground truth is a `streamrl.data.reasoning_gym.GymAnswer`: where the problem comes from.
The reward rebuilds the task's dataset from it (cached per dataset, in the reward worker:
reasoning-gym generates entry i from the seed alone, so it is the entry the prompt showed) and
scores the response's answer against that entry: the text inside its last
`<answer></answer>` (as reasoning-gym's `extract_answer` reads it, in linear time; none scores
0); with `data.reasoning_gym.answer: last_line`, its last non-empty line; with `last_number`,
its last number (for tasks whose answers are numbers, with models that do not write tags).

What the policy controls is only the response. An answer longer than `MAX_ANSWER_CHARS` scores 0
without reaching the task's scorer (some parse or evaluate what they are given), and a score
that is not a finite number in [0, 1] is refused as the reward's error, not trained on. Many
tasks' scorers give partial credit to an answer that contains the right one among others
(`len(expected) / len(answer)`), which pays a policy for hedging: unless
`data.reasoning_gym.partial_credit` is set, a score below 1 counts as 0. Like
every reward it runs in the reward workers, under their time and memory limits
(`streamrl.rewards.scoring`).
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import Any

from streamrl.data.reasoning_gym import INSTALL, GymAnswer, task_dataset

__all__ = ["MAX_ANSWER_CHARS", "load_reasoning_gym", "reasoning_gym_reward"]

MAX_ANSWER_CHARS = 4096
OPEN_TAG, CLOSE_TAG = "<answer>", "</answer>"


def load_reasoning_gym() -> None:
    """Import reasoning-gym now (a worker's startup, not its first call's time limit)."""
    try:
        import reasoning_gym  # noqa: F401
    except ImportError:
        raise ImportError(f"the reasoning_gym reward needs reasoning-gym; {INSTALL}") from None


def reasoning_gym_reward(response: str, ground_truth: str, *, prompt: str | None = None) -> float:
    """The task's score of `response`'s answer, in [0, 1] (module docstring); `prompt` is
    unused."""
    truth = GymAnswer.from_json(ground_truth)
    answer = _answer(response, truth.answer)
    if answer is None or len(answer) > MAX_ANSWER_CHARS:
        return 0.0
    settings = json.dumps(truth.config, sort_keys=True)
    try:
        dataset = _dataset(truth.task, truth.seed, truth.size, settings)
    except (TypeError, AssertionError) as error:  # settings the task does not take
        raise ValueError(
            f"task {truth.task} refused the ground truth's settings: {error}"
        ) from None
    if not 0 <= truth.index < len(dataset):
        raise ValueError(f"entry {truth.index} is outside task {truth.task}'s {len(dataset)}")
    score = dataset.score_answer(answer, dataset[truth.index])
    if not isinstance(score, int | float) or not math.isfinite(score):
        raise ValueError(f"task {truth.task}'s score_answer returned {score!r:.60}, not a number")
    if not 0.0 <= score <= 1.0:
        raise ValueError(f"task {truth.task}'s score_answer returned {score}, outside [0, 1]")
    return float(score) if truth.partial_credit or score >= 1.0 else 0.0


def _answer(response: str, where: str) -> str | None:
    if where == "last_line":
        lines = [line.strip() for line in response.strip().splitlines() if line.strip()]
        return lines[-1] if lines else None
    if where == "last_number":
        numbers = _NUMBER.findall(response[-MAX_ANSWER_CHARS:])
        return numbers[-1] if numbers else None
    return _tagged(response)


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
"""An integer or decimal, signed: `last_number` reads the response's last one."""


def _tagged(response: str) -> str | None:
    """The stripped text of the response's last `<answer>...</answer>` as reasoning-gym's
    `extract_answer` reads it (each opening tag closes at the first `</answer>` after it), in
    one pass: that function's regex rescans to the end from every unclosed tag, so a response
    of many unclosed tags (written to stall the reward) would outlast the worker's time limit."""
    answer, position = None, 0
    while (start := response.find(OPEN_TAG, position)) != -1:
        end = response.find(CLOSE_TAG, start + len(OPEN_TAG))
        if end == -1:
            break
        answer, position = response[start + len(OPEN_TAG) : end], end + len(CLOSE_TAG)
    return None if answer is None else answer.strip()


@functools.lru_cache(maxsize=64)
def _dataset(task: str, seed: int, size: int, settings: str) -> Any:
    return task_dataset(task, seed, size, json.loads(settings))
