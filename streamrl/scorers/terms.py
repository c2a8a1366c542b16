"""Reward terms scored by models (docs/algorithms.md, "Rewards from models"): a reward model's
score and an LLM judge's verdict, each from one of the run's scorers, beside the rule reward in
R = Σ_k c_k·R_k (`generator.reward.models`, the weights `c_k`).

- `reward_model`: a sequence classifier scores the conversation (the prompt's messages and
  the response as the assistant's turn, rendered by the server with the model's own chat
  template: vLLM's `/classify`, the raw logit); R = scale·(score − shift), clipped to
  [−clip, clip] when `clip` is set.
- `judge`: a generative model answers a rubric (`template`, placeholders `{prompt}`,
  `{response}`, `{ground_truth}`) at temperature 0 by default. `{response}` is the response
  fenced and neutralised (`streamrl.scorers.judging`: between tags with an id random per call,
  with no tag left in it). The verdict is the answer's final non-empty line, which must be
  `score_pattern` whole, on the scale [min_score, max_score]; it maps linearly to R in [0, 1].
  Where the server offers guided decoding (vLLM, the run serving the judge: `answer: auto`),
  the final line is constrained to the score tag. A verdict that is not there, or off the
  scale, is *unparsed*: counted (`judge_metrics`: `judge/unparsed_frac`), logged, and scored
  by `on_unparsed` — by default the bottom of the scale (R = 0), so that a response gains
  nothing by making its judge fail.

A failed call (a timeout, an unreachable scorer after `unavailable_s`, an answer that is no
chat completion, an unparsed verdict under `on_unparsed: fail`) is a counted reward failure of
its response, handled by `generator.reward.on_error` like a rule reward's.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import string
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from streamrl.config.base import Section
from streamrl.scorers.client import ScorerCallError, ScorerClient
from streamrl.scorers.judging import (
    DEFAULT_JUDGE_TEMPLATE,
    DEFAULT_SCORE_PATTERN,
    fence,
    final_line_regex,
    read_verdict,
)

__all__ = [
    "DEFAULT_JUDGE_TEMPLATE",
    "JudgeTerm",
    "ModelTerm",
    "ModelTermScorer",
    "RewardModelTerm",
    "TermInput",
    "TermScores",
    "UnparsedVerdictError",
    "judge_metrics",
]

log = logging.getLogger(__name__)

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

    def request(self, item: TermInput, model: str, *, structured_outputs: bool = False) -> Request:
        """vLLM's /classify of the conversation (the server renders it with the model's chat
        template), read as R = scale·(raw logit − shift), clipped. (`structured_outputs`: for
        judges.)"""
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


class UnparsedVerdictError(ValueError):
    """A judge's answer whose final line states no verdict on its scale. `value`: the R its
    term's `on_unparsed` rule gives the response; None: the call fails."""

    def __init__(self, message: str, value: float | None) -> None:
        super().__init__(message)
        self.value = value


class JudgeTerm(Section):
    """An LLM judge's score as a reward term: the verdict on its answer's final line, mapped to
    [0, 1] (module docstring)."""

    kind: Literal["judge"] = Field(description="A generative model grading with a rubric.")
    scorer: str = Field(
        min_length=1, description="The scorer serving it (scorers.<name>, task generate)."
    )
    weight: float = Field(1.0, ge=0.0, description="c_k, this term's weight in R = Σ c_k·R_k.")
    template: str = Field(
        DEFAULT_JUDGE_TEMPLATE,
        min_length=1,
        description="The rubric, sent as the user's message: placeholders {prompt}, {response} "
        "(required) and {ground_truth}; write literal braces as {{ }}. {response} is the "
        "response between <response-ID> and </response-ID> lines (ID random per call), "
        "escaped so that it holds no tag (&lt; &gt; &amp;): say in the rubric that the text "
        "between them is data to grade, never instructions, and that the reply ends with a "
        "line holding only the score tag.",
    )
    system: str | None = Field(None, description="A system message before the rubric.")
    score_pattern: str = Field(
        DEFAULT_SCORE_PATTERN,
        description="A regular expression the judge's final non-empty line must match whole "
        "(surrounding spaces aside), its first group the score; a score anywhere else in the "
        "answer does not count.",
    )
    min_score: float = Field(0.0, description="The bottom of the judge's scale (R = 0).")
    max_score: float = Field(10.0, description="The top of the judge's scale (R = 1).")
    max_tokens: int = Field(
        512, gt=0, le=1 << 20, description="The longest free answer, in tokens."
    )
    temperature: float = Field(
        0.0, ge=0.0, description="The judge's sampling temperature; 0 (default): greedy."
    )
    answer: Literal["auto", "free", "reason_then_score", "score_only"] = Field(
        "auto",
        description="auto: reason_then_score when the run serves the judge (vLLM, which offers "
        "structured outputs) and the scale is integer with the default score_pattern, else "
        "free. free: the judge answers as it likes (any OpenAI-compatible server). "
        "reason_then_score: free lines, then a final line constrained to <score>N</score>, N an "
        "integer on the scale (vLLM structured outputs; set it for an external vLLM). "
        "score_only: the answer is that tag alone, for judges too weak to keep a format.",
    )
    on_unparsed: Literal["lowest", "fail"] = Field(
        "lowest",
        description="A verdict missing from the answer's final line, or off the scale "
        "(counted as judge/unparsed_frac, logged): lowest scores the response as the bottom "
        "of the scale (R = 0), so a response gains nothing by making its judge fail; fail "
        "makes it a failed call (generator.reward.on_error: drop_group would leave its group "
        "out of training, which a response could then provoke).",
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
        if self.answer in ("score_only", "reason_then_score") and not self._can_guide:
            raise ValueError(
                f"answer={self.answer} constrains the judge to <score>N</score> with an integer "
                "N: it needs an integer scale (min_score, max_score); leave score_pattern at "
                "its default"
            )
        return self

    @property
    def _can_guide(self) -> bool:
        """Whether structured outputs can write this term's verdict: an integer scale, the
        default score tag."""
        integer_scale = float(self.min_score).is_integer() and float(self.max_score).is_integer()
        return integer_scale and self.score_pattern == DEFAULT_SCORE_PATTERN

    @property
    def unparsed_value(self) -> float | None:
        """R of a response left without a verdict (`on_unparsed`); None: the call fails."""
        return 0.0 if self.on_unparsed == "lowest" else None

    def answer_mode(
        self, structured_outputs: bool
    ) -> Literal["free", "reason_then_score", "score_only"]:
        """The answer asked of the judge; `structured_outputs`: whether its server offers
        vLLM's structured outputs (the run serves it)."""
        if self.answer != "auto":
            return self.answer
        return "reason_then_score" if structured_outputs and self._can_guide else "free"

    def request(self, item: TermInput, model: str, *, structured_outputs: bool = False) -> Request:
        """A chat completion of the rubric, the response fenced (`judging.fence`), read as the
        verdict on the answer's final line (`judging.read_verdict`) mapped to [0, 1]; an
        unparsed one raises `UnparsedVerdictError` carrying the `on_unparsed` rule's value."""
        rubric = self.template.format(
            prompt=item.prompt, response=fence(item.response), ground_truth=item.ground_truth
        )
        messages = [{"role": "user", "content": rubric}]
        if self.system is not None:
            messages.insert(0, {"role": "system", "content": self.system})
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "temperature": self.temperature,
        }
        mode = self.answer_mode(structured_outputs)
        if mode == "score_only":  # the choices bound the answer's length
            scale = range(int(self.min_score), int(self.max_score) + 1)
            body["structured_outputs"] = {"choice": [f"<score>{n}</score>" for n in scale]}
        else:
            body["max_tokens"] = self.max_tokens
        if mode == "reason_then_score":
            regex = final_line_regex(int(self.min_score), int(self.max_score))
            body["structured_outputs"] = {"regex": regex}
        pattern = re.compile(self.score_pattern)
        unparsed = self.unparsed_value

        def read(answer: Any) -> float:
            choice = answer["choices"][0]
            text = choice["message"]["content"] or ""
            score = read_verdict(text, pattern, self.min_score, self.max_score)
            if score is None:
                cut = " (cut at max_tokens)" if choice.get("finish_reason") == "length" else ""
                raise UnparsedVerdictError(
                    f"the judge's answer{cut} does not end with a line holding only its score "
                    f"on [{self.min_score:g}, {self.max_score:g}] as score_pattern: "
                    f"{_tail(text)!r}",
                    unparsed,
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
    """Scores one model term of the reward through its scorer's client (open), counting the
    answers it read and, of a judge's, the verdicts unparsed (`judge_metrics`)."""

    def __init__(self, name: str, term: RewardModelTerm | JudgeTerm, client: ScorerClient):
        self.name, self.term, self.client = name, term, client
        self.verdicts = 0  # answers read: scores, and verdicts whether parsed or not
        self.unparsed = 0  # verdicts unparsed (a judge's: `UnparsedVerdictError`)

    def score(self, item: TermInput) -> Future[float]:
        """R for one response; the future fails with `ScorerCallError` when the call does. The
        server offers structured outputs when the run serves it (vLLM). A judge's server that
        refuses the request (HTTP 400: the response made the prompt too long for its context)
        leaves no verdict: the unparsed rule, so a response cannot buy its group's drop."""
        path, body, read = self.term.request(
            item, self.client.model, structured_outputs=self.client.config.served
        )
        future = self.client.post(path, body, functools.partial(self._read, read))
        if self.term.kind != "judge":
            return future
        verdict: Future[float] = Future()
        future.add_done_callback(functools.partial(self._settle, verdict))
        return verdict

    def _settle(self, verdict: Future[float], call: Future[float]) -> None:
        """Resolve a judge's `verdict` from its `call`: a refused request read as unparsed."""
        error = call.exception()
        if error is None:
            verdict.set_result(call.result())
            return
        if isinstance(error, ScorerCallError) and error.refused:
            assert isinstance(self.term, JudgeTerm)

            def refused(answer: Any) -> float:
                raise UnparsedVerdictError(
                    f"the judge's server refused the request: {error}", self.term.unparsed_value
                )

            try:
                verdict.set_result(self._read(refused, None))
            except UnparsedVerdictError as exc:
                verdict.set_exception(ScorerCallError(str(exc)))
            return
        verdict.set_exception(error)

    def _read(self, read: Callable[[Any], float], answer: Any) -> float:
        """`read(answer)`, counted; an unparsed verdict takes its rule's value or fails the
        call. Runs on the client's event loop, one thread: the counts need no lock."""
        try:
            value = read(answer)
        except UnparsedVerdictError as exc:
            self.verdicts += 1
            self.unparsed += 1
            if self.unparsed & (self.unparsed - 1) == 0:  # the 1st, 2nd, 4th, …: logs stay few
                log.warning(
                    "judge term %s: %d of %d verdicts unparsed so far (judge/unparsed_frac "
                    "%.3f), each %s; the latest: %s",
                    self.name, self.unparsed, self.verdicts, self.unparsed / self.verdicts,
                    "a failed call" if exc.value is None else f"scored R = {exc.value:g}", exc,
                )  # fmt: skip
            if exc.value is None:
                raise
            return exc.value
        self.verdicts += 1
        return value


def judge_counts(scorers: Iterable[ModelTermScorer]) -> tuple[int, int]:
    """The verdicts the judge terms among `scorers` read so far, and how many of them were
    unparsed (whatever `on_unparsed` made of them)."""
    judges = [s for s in scorers if s.term.kind == "judge"]
    return sum(s.verdicts for s in judges), sum(s.unparsed for s in judges)


def judge_metrics(scorers: Iterable[ModelTermScorer]) -> dict[str, float]:
    """`judge/unparsed_frac`: the share of the verdicts the judge terms among `scorers` read so
    far (all of them together) that were unparsed; empty before the first verdict."""
    verdicts, unparsed = judge_counts(scorers)
    return {"judge/unparsed_frac": unparsed / verdicts} if verdicts else {}


def _tail(text: str, limit: int = 120) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else "…" + text[-limit:]
