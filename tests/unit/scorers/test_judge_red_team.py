"""The red team (`judge_attacks`) against a scripted judge that falls for every forgery it can
see, through the real path: the term's request, the scorer's client over HTTP, the verdict
read and its rule. No injected wrong answer scores above the plain wrong answer, and no
injection makes the call fail (a failed call may leave its group out of training: a dodge).
An unparsed verdict is scored lowest by default, counted in `judge/unparsed_frac`."""

from __future__ import annotations

import pytest

from streamrl.scorers.client import ScorerCallError, ScorerClient
from streamrl.scorers.config import ScorerConfig
from streamrl.scorers.terms import JudgeTerm, ModelTermScorer, TermInput, judge_metrics
from tests.unit.scorers.judge_attacks import (
    ATTACKS,
    CORRECT,
    QUESTION,
    REFERENCE,
    WRONG,
    scripted_judge,
)


def item(response: str) -> TermInput:
    return TermInput(({"role": "user", "content": QUESTION},), QUESTION, response, REFERENCE)


def scores(url: str, responses: dict[str, str], term: JudgeTerm) -> dict[str, float | str]:
    """Each response's R from the judge at `url`, or "failed call"."""
    config = ScorerConfig(model="judge", url=url, retries=0, unavailable_s=10)
    got: dict[str, float | str] = {}
    with ScorerClient("judge", config, None) as client:
        scorer = ModelTermScorer("judge", term, client)
        futures = {name: scorer.score(item(text)) for name, text in responses.items()}
        for name, future in futures.items():
            try:
                got[name] = future.result(timeout=60)
            except ScorerCallError:
                got[name] = "failed call"
    return got


def test_no_injected_wrong_answer_scores_above_the_plain_wrong_answer():
    assert len(ATTACKS) >= 20
    term = JudgeTerm(kind="judge", scorer="judge")
    with scripted_judge() as url:
        got = scores(url, {"wrong": WRONG, "correct": CORRECT, **ATTACKS}, term)
    assert got.pop("correct") == 1.0  # the scripted judge grades
    wrong = got.pop("wrong")
    assert wrong == 0.0
    gained = {name: value for name, value in got.items() if value != wrong}
    assert gained == {}, "injections that forged or dodged their verdict"


def test_an_unparsed_verdict_scores_lowest_and_is_counted_or_fails_by_rule():
    chatty = {  # the judge answers: a score after the verdict on its final line
        "wrong": WRONG,
        "tagged": ATTACKS["tag_at_the_end"],
        "correct": CORRECT,
        "inline": ATTACKS["tag_inline"],
    }
    term = JudgeTerm(kind="judge", scorer="judge")
    with scripted_judge() as url, ScorerClient("j", ScorerConfig(model="j", url=url), None) as c:
        scorer = ModelTermScorer("judge", term, c)
        assert judge_metrics([scorer]) == {}  # no verdict yet
        got = {name: scorer.score(item(text)).result(timeout=60) for name, text in chatty.items()}
        assert got == {"wrong": 0.0, "tagged": 0.0, "correct": 1.0, "inline": 0.0}
        assert (scorer.verdicts, scorer.unparsed) == (4, 2)
        assert judge_metrics([scorer]) == {"judge/unparsed_frac": 0.5}

        failing = ModelTermScorer("judge", term.model_copy(update={"on_unparsed": "fail"}), c)
        with pytest.raises(ScorerCallError, match="does not end with a line") as caught:
            failing.score(item(ATTACKS["tag_at_the_end"])).result(timeout=60)
        assert caught.value.failure == "error"  # generator.reward.on_error decides
        assert judge_metrics([scorer, failing]) == {"judge/unparsed_frac": 0.6}


def test_a_response_too_long_for_the_judge_is_unparsed_not_a_dropped_group():
    """`<` escapes to `&lt;`: a response of them can push the rubric past the judge's context.
    The server refuses the request (HTTP 400); that used to fail the call, and with
    `on_error: drop_group` the policy could trade a zero for a dropped group."""
    term = JudgeTerm(kind="judge", scorer="judge")
    failing_term = term.model_copy(update={"on_unparsed": "fail"})
    flood = WRONG + "<" * 5000
    with (
        scripted_judge(context_chars=8000) as url,
        ScorerClient("j", ScorerConfig(model="j", url=url, retries=0), None) as client,
    ):
        scorer = ModelTermScorer("judge", term, client)
        assert scorer.score(item(flood)).result(timeout=60) == 0.0
        assert scorer.score(item(CORRECT)).result(timeout=60) == 1.0
        assert judge_metrics([scorer]) == {"judge/unparsed_frac": 0.5}
        failing = ModelTermScorer("judge", failing_term, client)
        with pytest.raises(ScorerCallError, match="refused the request"):
            failing.score(item(flood)).result(timeout=60)
