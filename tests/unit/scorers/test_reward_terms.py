"""The reward as a weighted sum of terms: configuration (names, scorers, templates, scales) and
how a generator weighs the terms into a record's rewards and correctness."""

from __future__ import annotations

import pytest
import torch

from streamrl.config.loading import load_config
from streamrl.generator.records import GeneratorStats, GroupRecords
from streamrl.scorers.terms import JudgeTerm, TermScores

SCORERS = (
    "scorers.judge.model=tiny-qwen2",
    "scorers.rm.model=tiny-qwen2-rm",
    "scorers.rm.task=classify",
)
JUDGE = ("generator.reward.models.judge.kind=judge", "generator.reward.models.judge.scorer=judge")
RM = ("generator.reward.models.rm.kind=reward_model", "generator.reward.models.rm.scorer=rm")


def config(*overrides: str):
    """The overrides with the scorers they name (a scorer nothing uses is refused)."""
    wanted = [o for o in SCORERS if any(f"scorer={o.split('.')[1]}" in x for x in overrides)]
    return load_config(["grpo", "tiny-cpu"], overrides=[*wanted, *overrides])


def test_the_terms_weigh_into_the_reward_and_correctness_reads_the_configured_term():
    cfg = config(
        *JUDGE, *RM, "generator.reward.models.judge.weight=0.2",
        "generator.reward.models.rm.weight=0.5", "generator.reward.weight=2.0",
    )  # fmt: skip
    records = GroupRecords(cfg, "gen0", GeneratorStats())
    rule = torch.tensor([1.0, 0.0, 1.0])
    terms = {
        "judge": TermScores([1.0, 0.3, 0.0], [None, None, "error"]),
        "rm": TermScores([-1.5, 2.0, 0.25], [None] * 3),
    }
    total, raw, stored = records._combined(rule, terms)
    math = torch.tensor([1.0, -1.0, 1.0])  # the rule reward, ±1
    want = 2.0 * math + 0.2 * torch.tensor([1.0, 0.3, 0.0]) + 0.5 * torch.tensor([-1.5, 2.0, 0.25])
    torch.testing.assert_close(total, want)
    torch.testing.assert_close(raw, rule)  # correctness: the rule's raw score
    assert sorted(stored) == ["judge", "math", "rm"]
    assert stored["math"].tolist() == [1.0, -1.0, 1.0]

    judged = config(*JUDGE, "generator.reward.correctness=judge")
    _, raw, _ = GroupRecords(judged, "gen0", GeneratorStats())._combined(rule, terms)
    torch.testing.assert_close(raw, torch.tensor([1.0, 0.3, 0.0]))


def test_without_model_terms_the_reward_is_the_rule_reward_and_nothing_more_is_stored():
    records = GroupRecords(config(), "gen0", GeneratorStats())
    total, raw, stored = records._combined(torch.tensor([1.0, 0.0]), None)
    assert total.tolist() == [1.0, -1.0]
    assert raw.tolist() == [1.0, 0.0]
    assert stored is None


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ((*JUDGE[:1], "generator.reward.models.judge.scorer=jury"), "names no scorer"),
        (
            ("generator.reward.models.judge.kind=judge", "generator.reward.models.judge.scorer=rm"),
            "needs task generate",
        ),
        ((*RM[:1], "generator.reward.models.rm.scorer=judge"), "needs task classify"),
        ((*JUDGE, "generator.reward.correctness=jury"), "names no term"),
        (("generator.reward.weight=0.5",), "there are none"),
        (
            (
                "generator.reward.models.math.kind=judge",
                "generator.reward.models.math.scorer=judge",
            ),
            "has the rule term's name",
        ),
        (
            (
                "generator.reward.models.Judge.kind=judge",
                "generator.reward.models.Judge.scorer=judge",
            ),
            "lower-case letters",
        ),
    ],
)
def test_a_reward_term_that_cannot_work_is_refused_naming_the_fix(overrides, match):
    with pytest.raises(Exception, match=match):
        config(*overrides)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"template": "Grade {answer}"}, "placeholders \\['answer'\\]"),
        ({"template": "Grade the question {prompt}"}, "add \\{response\\}"),
        ({"template": "Grade {response"}, "not a format string"),
        ({"score_pattern": "<score>\\d+</score>"}, "needs a group"),
        ({"score_pattern": "(["}, "not a regular expression"),
        ({"min_score": 5, "max_score": 5}, "must be above"),
        ({"answer": "score_only", "max_score": 1.5}, "integer scale"),
        ({"answer": "score_only", "score_pattern": "Score: (\\d+)"}, "leave score_pattern"),
        ({"template": "Grade {response:d}"}, "without format specs"),
    ],
)
def test_a_judge_rubric_is_checked_when_configured(fields, match):
    with pytest.raises(ValueError, match=match):
        JudgeTerm(kind="judge", scorer="judge", **fields)
    literal = JudgeTerm(kind="judge", scorer="j", template="{{json}} {response} {ground_truth}")
    assert literal.template.format(response="r", ground_truth="g", prompt="p") == "{json} r g"


def test_a_user_functions_term_is_named_rule_and_its_records_validate():
    cfg = config(*JUDGE, "generator.reward.fn=tests.reward_fns:scripted")
    assert cfg.generator.reward.rule_term == "rule"
    records = GroupRecords(cfg, "gen0", GeneratorStats())
    _, _, stored = records._combined(torch.tensor([1.0]), {"judge": TermScores([0.5], [None])})
    assert sorted(stored) == ["judge", "rule"]


def test_a_served_scorer_nothing_uses_is_refused():
    with pytest.raises(Exception, match="scorers judge would be served"):
        load_config(["grpo", "tiny-cpu"], overrides=["scorers.judge.model=tiny-qwen2"])
    external = load_config(
        ["grpo", "tiny-cpu"], overrides=["scorers.judge.url=http://x/v1", "scorers.judge.model=j"]
    )
    assert external.served_scorers == []  # an endpoint nobody calls costs nothing
