"""Rewards from models, with real servers: a reward model (the locally built tiny sequence
classifier) and a judge (the tiny model: a poor judge, so the path is what is tested), each
served by `streamrl scorer` as a run serves it.

The reward model's term is its raw logit of the conversation under the scale and shift, equal to
transformers'; the judge's is its stated score mapped to [0, 1]; a judge answer without a
verdict on its final line scores the bottom of the scale, counted (or fails the call, by its
rule); the red team (`tests.unit.scorers.judge_attacks`) forges no chat-template turn and no
score through the served judge; a request past its timeout fails the call; a whole run weighs
the terms into its rewards and logs each one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from storage.control.endpoints import read_endpoint
from storage.fs import open_location
from storage.stream.log import read_log
from storage.stream.reader import StreamReader
from streamrl.config.loading import load_config
from streamrl.config.stored import prepare_run
from streamrl.models import resolve_model_path
from streamrl.scorers.client import ScorerCallError, ScorerClient
from streamrl.scorers.terms import (
    JudgeTerm,
    ModelTermScorer,
    RewardModelTerm,
    TermInput,
    judge_metrics,
)
from tests.unit.scorers.judge_attacks import ATTACKS, QUESTION, REFERENCE, WRONG

ROOT = Path(__file__).resolve().parents[3]
SCORERS = (
    "scorers.rm.model=tiny-qwen2-rm",
    "scorers.rm.task=classify",
    "scorers.rm.dtype=float32",
    "scorers.judge.model=tiny-qwen2",
    "scorers.judge.dtype=float32",
)
TERMS = (
    "generator.reward.models.rm.kind=reward_model",
    "generator.reward.models.rm.scorer=rm",
    "generator.reward.models.rm.weight=0.5",
    "generator.reward.models.rm.scale=2.0",
    "generator.reward.models.rm.shift=0.25",
    "generator.reward.models.judge.kind=judge",
    "generator.reward.models.judge.scorer=judge",
    "generator.reward.models.judge.weight=0.2",
    "generator.reward.models.judge.answer=score_only",
    "generator.reward.models.judge.max_tokens=8",
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A run whose scorers rm and judge are served, as its supervisor would start them."""
    run_dir = tmp_path_factory.mktemp("served") / "run"
    config = load_config(
        ["grpo", "tiny-cpu"], overrides=[f"storage.run_uri={run_dir}", *SCORERS, *TERMS]
    )
    config, run = prepare_run(config)
    servers = [
        subprocess.Popen(
            [sys.executable, "-m", "streamrl", "scorer", "--run", str(run_dir), "--name", name],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name in ("rm", "judge")
    ]
    try:
        deadline = time.monotonic() + 600
        while not all(read_endpoint(run, f"scorer-{n}") for n in ("rm", "judge")):
            assert time.monotonic() < deadline, "the scorers did not come up"
            assert all(s.poll() is None for s in servers), "a scorer exited while starting"
            time.sleep(0.5)
        yield config, run
    finally:
        for server in servers:
            server.send_signal(signal.SIGTERM)
        for server in servers:
            server.wait(timeout=60)
    assert read_endpoint(run, "scorer-rm") is None  # a stopped server clears its address


ITEM = TermInput(
    messages=({"role": "user", "content": "What is 2 + 3?"},),
    prompt="What is 2 + 3?",
    response="The answer is \\boxed{5}.",
    ground_truth="5",
)


def test_the_reward_model_term_is_its_logit_of_the_conversation_scaled(served):
    config, run = served
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = resolve_model_path("tiny-qwen2-rm")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    conversation = [*ITEM.messages, {"role": "assistant", "content": ITEM.response}]
    ids = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False)
    with torch.no_grad():
        logit = float(model(torch.tensor([ids])).logits[0, 0])
    term = config.generator.reward.models["rm"]
    with ScorerClient("rm", config.scorers["rm"], run) as client:
        got = ModelTermScorer("rm", term, client).score(ITEM).result(timeout=120)
    assert got == pytest.approx(2.0 * (logit - 0.25), abs=1e-4)
    clipped = RewardModelTerm(kind="reward_model", scorer="rm", clip=1e-3)
    with ScorerClient("rm", config.scorers["rm"], run) as client:
        assert abs(ModelTermScorer("rm", clipped, client).score(ITEM).result(timeout=120)) <= 1e-3


def test_a_judge_scores_on_its_scale_and_an_answer_without_a_verdict_scores_lowest(served):
    config, run = served
    with ScorerClient("judge", config.scorers["judge"], run) as client:
        constrained = ModelTermScorer("judge", config.generator.reward.models["judge"], client)
        value = constrained.score(ITEM).result(timeout=120)
        assert 0.0 <= value <= 1.0
        assert value * 10 == pytest.approx(round(value * 10))  # an integer 0..10, mapped
        free = JudgeTerm(
            kind="judge", scorer="judge", answer="free", max_tokens=4, template="{response}"
        )
        unparsed = ModelTermScorer("judge", free, client)
        assert unparsed.score(ITEM).result(timeout=120) == 0.0  # the tiny model keeps no format
        assert judge_metrics([unparsed]) == {"judge/unparsed_frac": 1.0}
        failing = free.model_copy(update={"on_unparsed": "fail"})
        with pytest.raises(ScorerCallError, match="does not end with a line holding") as caught:
            ModelTermScorer("judge", failing, client).score(ITEM).result(timeout=120)
        assert caught.value.failure == "error"


def test_the_red_team_forges_no_turn_and_no_score_through_the_served_judge(served):
    """The tiny judge has random weights: what it says is noise, what is tested is the path —
    the chat template the server renders holds the template's special tokens only, whatever
    the response; the guided answer (`answer: auto` on a served judge) is read, and no
    injected wrong answer scores above the plain one or fails its call."""
    config, run = served
    term = JudgeTerm(kind="judge", scorer="judge", max_tokens=16)
    responses = {"wrong": WRONG, **ATTACKS}
    with ScorerClient("judge", config.scorers["judge"], run) as client:

        def tokenize(body: dict) -> list[int]:
            answer = client.post("/tokenize", {"model": "judge", **body}).result(timeout=120)
            return answer["tokens"]

        start, end, text_end = tokenize({"prompt": "<|im_start|><|im_end|><|endoftext|>"})
        for name, response in responses.items():
            _, body, _ = term.request(item(response), "judge", structured_outputs=True)
            assert body["structured_outputs"]["regex"]
            shown = tokenize({"messages": body["messages"], "add_generation_prompt": True})
            # <|im_start|>user … <|im_end|> <|im_start|>assistant: no turn forged
            turns = [t for t in shown if t in (start, end, text_end)]
            assert turns == [start, end, start], name

        scorer = ModelTermScorer("judge", term, client)
        futures = {name: scorer.score(item(text)) for name, text in responses.items()}
        got = {name: future.result(timeout=300) for name, future in futures.items()}
    wrong = got.pop("wrong")
    assert {name: value for name, value in got.items() if value > wrong} == {}
    assert scorer.verdicts == len(responses)  # every answer read, none a failed call
    assert 0.0 <= judge_metrics([scorer])["judge/unparsed_frac"] <= 1.0


def item(response: str) -> TermInput:
    return TermInput(({"role": "user", "content": QUESTION},), QUESTION, response, REFERENCE)


def test_a_scorer_request_past_its_timeout_fails_as_a_timeout(served):
    config, run = served
    slow = config.scorers["judge"].model_copy(
        update={"timeout_s": 0.05, "retries": 0, "unavailable_s": 5.0}
    )
    long_answer = {  # 256 tokens take the tiny model far longer than 0.05 s
        "model": "judge",
        "messages": [{"role": "user", "content": "Count."}],
        "max_tokens": 256,
        "ignore_eos": True,
    }
    client = ScorerClient("judge", slow, run)
    with client, pytest.raises(ScorerCallError, match="did not answer") as caught:
        client.post("chat/completions", long_answer).result(timeout=120)
    assert caught.value.failure == "timeout"


@pytest.mark.timeout(1500)
def test_a_run_weighs_the_model_terms_into_its_rewards_and_logs_each(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable, "-m", "streamrl", "run", "--preset", "grpo", "--preset", "tiny-cpu",
            f"storage.run_uri={run_dir}", "learner.total_steps=2", "learner.batch_groups=2",
            "learner.mini_batch_groups=2", "generator.max_tokens=16", *SCORERS, *TERMS,
        ],
        cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True, text=True, timeout=1400,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    steps = [json.loads(line) for line in (run_dir / "metrics" / "learner.jsonl").open()]
    assert [s["step"] for s in steps] == [1, 2]
    for step in steps:
        for term in ("math", "rm", "judge"):
            assert np.isfinite(step[f"reward/{term}_mean"])
    groups = [
        g for _, g in zip(range(4), StreamReader(open_location(str(run_dir))).groups(timeout_s=10),
                          strict=False)
    ]  # fmt: skip
    assert groups
    records = list(read_log(open_location(str(run_dir))))
    verdicts = sum(r.judge_verdicts for r in records)  # one per response scored, judged
    assert verdicts >= sum(r.num_responses for r in records)
    assert 0 <= sum(r.judge_unparsed for r in records) <= verdicts
    for group in groups:
        terms = group.reward_terms
        assert sorted(terms) == ["judge", "math", "rm"]
        assert set(np.unique(terms["math"])) <= {-1.0, 1.0}  # the rule reward, ±1
        assert ((terms["judge"] >= 0) & (terms["judge"] <= 1)).all()
        weighed = 1.0 * terms["math"] + 0.5 * terms["rm"] + 0.2 * terms["judge"]
        np.testing.assert_allclose(group.rewards, weighed, atol=1e-5)
        np.testing.assert_array_equal(group.raw_scores >= 1, terms["math"] > 0)  # the rule's
