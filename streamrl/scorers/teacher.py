"""A generator's teacher (on-policy distillation): its log-probs of every token of a group's
episodes, read at the episodes' exact token ids.

One request per group, off the sampling path: POST /completions with the G token histories
(prompt + response, environment tokens included) as the prompts, `prompt_logprobs: 0` (the
log-prob of each given token, one prefill) and one sampled token that is thrown away. Response
token t of episode i is prompt position P + t; its log-prob is the teacher's at temperature 1,
its own distribution. The answer is checked before it is used — one entry per position, each
naming the token given, a finite log-prob ≤ 0 — and a position the policy did not sample
(loss mask 0: an environment token) stores 0. An unusable answer fails the call
(`ScorerCallError`), as a timeout does: the generator leaves the group out (there is nothing
to stand in for log-probs) and counts it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from streamrl.scorers.client import ScorerClient

__all__ = ["Teacher", "TeacherScores"]

LOGPROB_SLACK = 1e-4  # a log-prob above 0 by this much is rounding: read as 0


@dataclass(frozen=True)
class TeacherScores:
    """One group's teacher log-probs: G arrays `[L_i] float32` (0 off the loss mask), and how
    long the request took (wall seconds)."""

    logprobs: list[np.ndarray]
    seconds: float


class Teacher:
    """Scores groups with the teacher behind `client` (open)."""

    def __init__(self, client: ScorerClient) -> None:
        self.client = client

    def score(
        self,
        prompt_ids: Sequence[int],
        responses: Sequence[np.ndarray],
        masks: Sequence[np.ndarray],
    ) -> Future[TeacherScores]:
        """The teacher's log-probs of each response's tokens (`responses[i]`, int32) after
        `prompt_ids`; `masks[i]` (uint8, 1 = sampled by the policy) zeroes the others."""
        prompt = [int(t) for t in prompt_ids]
        asked = [i for i, r in enumerate(responses) if len(r)]  # an empty response: nothing
        body: dict[str, Any] = {
            "model": self.client.model,
            "prompt": [prompt + [int(t) for t in responses[i]] for i in asked],
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": 0,
        }
        started = time.monotonic()

        def read(answer: Any) -> TeacherScores:
            found = _prompt_logprobs(answer, len(asked))
            logprobs = [np.zeros(len(r), np.float32) for r in responses]
            for k, i in enumerate(asked):
                logprobs[i] = _response_logprobs(found[k], len(prompt), responses[i], masks[i], i)
            return TeacherScores(logprobs, time.monotonic() - started)

        if not asked:
            done: Future[TeacherScores] = Future()
            done.set_result(TeacherScores([np.zeros(0, np.float32) for _ in responses], 0.0))
            return done
        return self.client.post("completions", body, read)


def _prompt_logprobs(answer: Any, expected: int) -> list[list[Any]]:
    """Each choice's `prompt_logprobs`, in prompt order."""
    choices = answer["choices"]
    if not isinstance(choices, list) or len(choices) != expected:
        raise ValueError(f"expected {expected} choices, got {len(choices)}")
    ordered = sorted(choices, key=lambda c: int(c["index"]))
    if [int(c["index"]) for c in ordered] != list(range(expected)):
        raise ValueError("the choices' indexes are not 0..G-1")
    found = [c["prompt_logprobs"] for c in ordered]
    if any(not isinstance(entries, list) for entries in found):
        raise ValueError("a choice has no prompt_logprobs (is the endpoint vLLM?)")
    return found


def _response_logprobs(
    entries: list[Any], prompt_len: int, tokens: np.ndarray, mask: np.ndarray, i: int
) -> np.ndarray:
    if len(entries) != prompt_len + len(tokens):
        raise ValueError(
            f"response {i}: {len(entries)} prompt_logprobs for {prompt_len + len(tokens)} tokens"
        )
    out = np.zeros(len(tokens), np.float32)
    for t, token in enumerate(tokens):
        if not mask[t]:
            continue
        entry = entries[prompt_len + t]
        value = entry[str(int(token))]["logprob"]
        if not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"response {i}, token {t}: log-prob {value!r} is not finite")
        if value > LOGPROB_SLACK:
            raise ValueError(f"response {i}, token {t}: log-prob {value} is above 0")
        out[t] = min(value, 0.0)
    return out
