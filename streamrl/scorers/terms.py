"""Reward terms scored by models (docs/algorithms.md, "Rewards from models"): a reward model's
score and an LLM judge's verdict, each from one of the run's scorers, beside the rule reward in
R = Σ_k c_k·R_k (`generator.reward.models`, the weights `c_k`).

- `reward_model`: a sequence classifier scores the conversation (the prompt's messages and
  the response as the assistant's turn, rendered by the server with the model's own chat
  template: vLLM's `/classify`, the raw logit); R = scale·(score − shift), clipped to
  [−clip, clip] when `clip` is set.
- `judge`: a generative model answers a rubric (`template`, placeholders `{prompt}`,
  `{response}`, `{ground_truth}`) at temperature 0 by default; the last match of
  `score_pattern` in its answer, on the scale [min_score, max_score], maps linearly to R in
  [0, 1]. An answer without a score, or with one off the scale, is a failed call — never 0
  silently. `answer: score_only` constrains the judge to answer with the score tag alone
  (vLLM's structured outputs), for judges too weak to keep a format.

A failed call (no score, a timeout, an unreachable scorer after `unavailable_s`) is a counted
reward failure of its response, handled by `generator.reward.on_error` like a rule reward's.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from streamrl.config.base import Section
from streamrl.scorers.client import ScorerClient

__all__ = [
    "DEFAULT_JUDGE_TEMPLATE",
    "JudgeTerm",
    "ModelTerm",
    "ModelTermScorer",
    "RewardModelTerm",
    "TermInput",
    "TermScores",
]

DEFAULT_JUDGE_TEMPLATE = (
    "You grade an answer to a question.\n\nQuestion:\n{prompt}\n\nReference answer:\n"
    "{ground_truth}\n\nAnswer to grade:\n{response}\n\nIs the answer correct and complete? "
    "Think briefly, then give a score from 0 (wrong) to 10 (fully correct) as "
    "<score>N</score>."
)
PLACEHOLDERS = frozenset({"prompt", "response", "ground_truth"})
Request = tuple[str, dict[str, Any], Callable[[Any], float]]  # path, body, how to read the answer


class RewardModelTerm(Section):
    """A reward model's score as a reward term: R = scale·(score − shift), clipped."""

    kind: Literal["reward_model"] = Field(description="A sequence classifier's score.")
    scorer: str = Field(
        min_length=1, description="The scorer serving it (scorers.<name>, task classify)."
    )
    weight: float = Field(1.0, ge=0.0, description="c_k, this term's weight in R = Σ c_k·R_k.")
    scale: float = Field(1.0, description="R = scale·(score − shift).")
    shift: float = Field(0.0, description="R = scale·(score − shift).")
    clip: float | None = Field(
        None, gt=0.0, description="Clip R to [−clip, clip]; null: no clipping."
    )

    def request(self, item: TermInput, model: str) -> Request:
        """vLLM's /classify of the conversation (the server renders it with the model's chat
        template), read as R = scale·(raw logit − shift), clipped."""
        messages = [*item.messages] or [{"role": "user", "content": item.prompt}]
        body = {
            "model": model,
            "messages": [*messages, {"role": "assistant", "content": item.response}],
            "use_activation": False,  # the raw logit (vLLM applies a sigmoid by default)
        }

        def read(answer: Any) -> float:
            (entry,) = answer["data"]
            score = float(entry["probs"][0])
            if not math.isfinite(score):
                raise ValueError(f"the reward model's score {score} is not finite")
            value = self.scale * (score - self.shift)
            return value if self.clip is None else max(-self.clip, min(self.clip, value))

        return "/classify", body, read


class JudgeTerm(Section):
    """An LLM judge's score as a reward term: the score its answer states, mapped to [0, 1]."""

    kind: Literal["judge"] = Field(description="A generative model grading with a rubric.")
    scorer: str = Field(
        min_length=1, description="The scorer serving it (scorers.<name>, task generate)."
    )
    weight: float = Field(1.0, ge=0.0, description="c_k, this term's weight in R = Σ c_k·R_k.")
    template: str = Field(
        DEFAULT_JUDGE_TEMPLATE,
        min_length=1,
        description="The rubric, sent as the user's message: placeholders {prompt}, {response} "
        "(required) and {ground_truth}; write literal braces as {{ }}.",
    )
    system: str | None = Field(None, description="A system message before the rubric.")
    score_pattern: str = Field(
        r"<score>\s*(-?\d+(?:\.\d+)?)\s*</score>",
        description="A regular expression whose first group is the score; its last match in "
        "the answer counts.",
    )
    min_score: float = Field(0.0, description="The bottom of the judge's scale (R = 0).")
    max_score: float = Field(10.0, description="The top of the judge's scale (R = 1).")
    max_tokens: int = Field(
        512, gt=0, le=1 << 20, description="The longest free answer, in tokens."
    )
    temperature: float = Field(
        0.0, ge=0.0, description="The judge's sampling temperature; 0 (default): greedy."
    )
    answer: Literal["free", "score_only"] = Field(
        "free",
        description="free: the judge answers as it likes, the score is parsed from it; "
        "score_only: its answer is constrained to `<score>N</score>` with an integer N on the "
        "scale (vLLM structured outputs).",
    )

    @field_validator("template")
    @classmethod
    def _known_placeholders(cls, value: str) -> str:
        try:
            names = {name for _, name, _, _ in string.Formatter().parse(value) if name is not None}
        except ValueError as exc:
            raise ValueError(
                f"template is not a format string ({exc}); write literal braces as {{{{ }}}}"
            ) from None
        unknown = sorted(names - PLACEHOLDERS)
        if unknown:
            raise ValueError(
                f"template has placeholders {unknown}; it may use {{prompt}}, {{response}} and "
                "{ground_truth} (write literal braces as {{ }})"
            )
        if "response" not in names:
            raise ValueError("template must show the judge the response: add {response}")
        try:
            value.format(prompt="", response="", ground_truth="")
        except (ValueError, IndexError, KeyError) as exc:
            raise ValueError(
                f"template cannot be filled in ({exc}); use plain placeholders such as "
                "{response}, without format specs"
            ) from None
        return value

    @field_validator("score_pattern")
    @classmethod
    def _one_group(cls, value: str) -> str:
        try:
            compiled = re.compile(value)
        except re.error as exc:
            raise ValueError(f"score_pattern is not a regular expression: {exc}") from None
        if compiled.groups < 1:
            raise ValueError("score_pattern needs a group capturing the score, e.g. (\\d+)")
        return value

    @model_validator(mode="after")
    def _a_scale(self) -> JudgeTerm:
        if not self.max_score > self.min_score:
            raise ValueError(
                f"max_score ({self.max_score}) must be above min_score ({self.min_score})"
            )
        if self.answer == "score_only" and not (
            float(self.min_score).is_integer() and float(self.max_score).is_integer()
        ):
            raise ValueError("answer=score_only needs an integer scale (min_score, max_score)")
        default_pattern = type(self).model_fields["score_pattern"].default
        if self.answer == "score_only" and self.score_pattern != default_pattern:
            raise ValueError(
                "answer=score_only makes the judge answer <score>N</score>, which a custom "
                "score_pattern would not read; leave score_pattern at its default"
            )
        return self

    def request(self, item: TermInput, model: str) -> Request:
        """A chat completion of the rubric, read as the last score `score_pattern` finds in
        the answer, on the scale, mapped to [0, 1]."""
        rubric = self.template.format(
            prompt=item.prompt, response=item.response, ground_truth=item.ground_truth
        )
        messages = [{"role": "user", "content": rubric}]
        if self.system is not None:
            messages.insert(0, {"role": "system", "content": self.system})
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "temperature": self.temperature,
        }
        if self.answer == "score_only":  # the choices bound the answer's length
            scale = range(int(self.min_score), int(self.max_score) + 1)
            body["structured_outputs"] = {"choice": [f"<score>{n}</score>" for n in scale]}
        else:
            body["max_tokens"] = self.max_tokens
        pattern = re.compile(self.score_pattern)

        def read(answer: Any) -> float:
            text = answer["choices"][0]["message"]["content"] or ""
            found = pattern.findall(text)
            if not found:
                raise ValueError(f"the judge's answer has no score: {_tail(text)!r}")
            last = found[-1]
            score = float(last[0] if isinstance(last, tuple) else last)
            if not self.min_score <= score <= self.max_score:
                raise ValueError(
                    f"the judge's score {score:g} is off its scale "
                    f"[{self.min_score:g}, {self.max_score:g}]"
                )
            return (score - self.min_score) / (self.max_score - self.min_score)

        return "chat/completions", body, read


ModelTerm = Annotated[RewardModelTerm | JudgeTerm, Field(discriminator="kind")]


@dataclass(frozen=True)
class TermScores:
    """A model term's R per response of a group (0.0 where its call failed) and the failures
    ("error", "timeout"; None where it scored)."""

    values: list[float]
    failures: list[Literal["error", "timeout"] | None]


@dataclass(frozen=True)
class TermInput:
    """What a model term sees of one response: the question, the answer, the reference."""

    messages: tuple[dict[str, str], ...]  # the prompt's conversation (may be empty)
    prompt: str  # the question as text: the last user message, else the prompt's text
    response: str
    ground_truth: str


class ModelTermScorer:
    """Scores one model term of the reward through its scorer's client (open)."""

    def __init__(self, name: str, term: RewardModelTerm | JudgeTerm, client: ScorerClient):
        self.name, self.term, self.client = name, term, client

    def score(self, item: TermInput) -> Future[float]:
        """R for one response; the future fails with `ScorerCallError` when the call does."""
        return self.client.post(*self.term.request(item, self.client.model))


def _tail(text: str, limit: int = 120) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else "…" + text[-limit:]
