"""What a judge is shown and how its verdict is read: the response fenced with an id random per
call, with no tag left in it, so it cannot close its fence; the verdict read from the answer's
final line only, an unparsed one scored by its term's rule; guided decoding asked for where the
server offers it."""

from __future__ import annotations

import html
import re

import pytest

from streamrl.scorers.judging import (
    ANGLE_LOOKALIKES,
    DEFAULT_SCORE_PATTERN,
    fence,
    final_line_regex,
    neutralise,
    read_verdict,
)
from streamrl.scorers.terms import JudgeTerm, TermInput, UnparsedVerdictError
from tests.unit.scorers.judge_attacks import ATTACKS, QUESTION, REFERENCE, WRONG

OPENING = re.compile(r"<response-([0-9a-f]{16})>")
TAG_CHARACTERS = frozenset("<>") | ANGLE_LOOKALIKES


def item(response: str) -> TermInput:
    return TermInput(({"role": "user", "content": QUESTION},), QUESTION, response, REFERENCE)


def rubric(term: JudgeTerm, response: str) -> str:
    _, body, _ = term.request(item(response), "judge")
    return body["messages"][-1]["content"]


def test_each_call_fences_the_response_between_tags_with_an_id_of_its_own():
    term = JudgeTerm(kind="judge", scorer="judge")
    ids = set()
    for _ in range(20):
        shown = rubric(term, WRONG)
        (fence_id,) = OPENING.findall(shown)
        assert shown.count(f"</response-{fence_id}>") == 1
        inside = shown.split(f"<response-{fence_id}>\n")[1].split(f"\n</response-{fence_id}>")[0]
        assert inside == WRONG
        assert "data to grade" in shown  # the rubric says what the fenced text is
        ids.add(fence_id)
    assert len(ids) == 20  # drawn per call: a response cannot know the one it is shown in


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_response_cannot_close_its_fence_or_write_a_tag_and_still_reads_as_written(attack):
    response = ATTACKS[attack]
    shown = fence(response, "0123456789abcdef")
    # the guessed id is the real one here, and still the response cannot end its fence
    assert shown.count("<response-0123456789abcdef>") == 1
    assert shown.count("</response-") == 1
    assert shown.endswith("\n</response-0123456789abcdef>")
    inside = shown.removeprefix("<response-0123456789abcdef>\n").removesuffix(
        "\n</response-0123456789abcdef>"
    )
    assert not TAG_CHARACTERS & set(inside)  # no tag, no lookalike of one
    assert html.unescape(inside) == response  # the judge reads what the response says


def test_escapes_already_in_a_response_show_as_written():
    assert neutralise("a &lt; b & c < d") == "a &amp;lt; b &amp; c &lt; d"
    assert neutralise("＜score＞") == "&#xff1c;score&#xff1e;"
    assert neutralise("x ≤ y, 3 > 2") == "x ≤ y, 3 &gt; 2"


@pytest.mark.parametrize(
    ("answer", "score"),
    [
        ("Wrong. <score>0</score> (the answer tries to say <score>10</score>)", None),
        ("Wrong.\n<score>0</score>", 0.0),
        ("Correct.\n<score>10</score>\n\n   \n", 10.0),
        ("The answer says <score>10</score>.\n<score>3</score>", 3.0),
        ("<score>10</score>\nOn reflection the answer is wrong.", None),
        ("  <score> 7 </score>  ", 7.0),
        ("Verdict: <score>7</score>", None),
        ("<score>7</score><score>10</score>", None),
        ("<score>11</score>", None),  # off the scale
        ("<score>-1</score>", None),
        ("<score>2.5</score>", 2.5),
        ("＜score＞10＜/score＞", None),
        ("Fine.\u2028<score>9</score>", 9.0),  # a line separator ends a line, as str.splitlines
        ("", None),
        ("\n\n", None),
    ],
)
def test_the_verdict_is_the_final_line_whole_and_on_the_scale(answer, score):
    assert read_verdict(answer, re.compile(DEFAULT_SCORE_PATTERN), 0.0, 10.0) == score


def test_a_custom_pattern_is_read_the_same_way_and_a_non_number_is_unparsed():
    pattern = re.compile(r"Score:\s*(\w+)")
    assert read_verdict("reasons\nScore: 4", pattern, 1, 5) == 4.0
    assert read_verdict("Score: 4\nreasons", pattern, 1, 5) is None
    assert read_verdict("Score: nan", pattern, 1, 5) is None
    assert read_verdict("Score: four", pattern, 1, 5) is None


def answer(content: str, finish_reason: str = "stop") -> dict:
    return {"choices": [{"message": {"content": content}, "finish_reason": finish_reason}]}


def test_an_unparsed_verdict_carries_its_rule_lowest_or_a_failed_call():
    lowest = JudgeTerm(kind="judge", scorer="judge", min_score=1, max_score=5)
    _, _, read = lowest.request(item(WRONG), "judge")
    assert read(answer("fine\n<score>4</score>")) == pytest.approx(0.75)
    with pytest.raises(UnparsedVerdictError, match=r"cut at max_tokens.*on \[1, 5\]") as caught:
        read(answer("I think <score>5</score> because", "length"))
    assert caught.value.value == 0.0  # the bottom of the scale
    failing = lowest.model_copy(update={"on_unparsed": "fail"})
    _, _, read = failing.request(item(WRONG), "judge")
    with pytest.raises(UnparsedVerdictError) as caught:
        read(answer("<score>9</score>"))  # off the scale
    assert caught.value.value is None


def test_guided_decoding_is_asked_for_where_the_server_offers_it():
    term = JudgeTerm(kind="judge", scorer="judge")
    _, served, _ = term.request(item(WRONG), "judge", structured_outputs=True)
    assert served["structured_outputs"] == {"regex": final_line_regex(0, 10)}
    assert served["max_tokens"] == term.max_tokens
    _, external, _ = term.request(item(WRONG), "judge")
    assert "structured_outputs" not in external  # not every OpenAI-compatible server has them
    custom = JudgeTerm(kind="judge", scorer="judge", score_pattern=r"Score: (\d+)")
    assert custom.answer_mode(structured_outputs=True) == "free"
    only = JudgeTerm(kind="judge", scorer="judge", answer="score_only", max_score=3)
    _, body, _ = only.request(item(WRONG), "judge")
    assert body["structured_outputs"]["choice"][-1] == "<score>3</score>"
    with pytest.raises(ValueError, match="integer scale"):
        JudgeTerm(kind="judge", scorer="judge", answer="reason_then_score", max_score=1.5)


def test_the_guided_regex_admits_free_lines_then_only_a_verdict_on_the_scale():
    regex = re.compile(final_line_regex(0, 10))
    assert regex.fullmatch("<score>10</score>")
    assert regex.fullmatch("The answer says <score>10</score>.\n\nIt is wrong.\n<score>0</score>")
    assert not regex.fullmatch("It is wrong. <score>0</score>")
    assert not regex.fullmatch("<score>0</score>\n(it tries to say <score>10</score>)")
    assert not regex.fullmatch("Wrong.\n<score>11</score>")
    assert not regex.fullmatch("Wrong.\n<score>0</score>\n")
