"""The teacher's answer is checked before it is used; a scorer that cannot be reached fails the
call after `unavailable_s`, counted, never silently; a teacher whose tokenizer is not the
policy's is refused naming the difference, before its server starts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from storage.fs import open_location
from streamrl.config.loading import load_config
from streamrl.config.stored import prepare_run
from streamrl.models import resolve_model_path
from streamrl.scorers.client import ScorerCallError, ScorerClient
from streamrl.scorers.config import ScorerConfig
from streamrl.scorers.teacher import _prompt_logprobs, _response_logprobs
from streamrl.scorers.tokenizers import tokenizer_difference
from streamrl.supervision.policy import USER_CODE_EXIT_CODE

ROOT = Path(__file__).resolve().parents[3]


def entries(tokens, values):
    return [
        None,
        *({str(t): {"logprob": v, "rank": 1}} for t, v in zip(tokens, values, strict=True)),
    ]


def test_the_teacher_reads_each_token_it_was_given_and_zeroes_environment_tokens():
    prompt, response = [5, 6], np.array([7, 8, 9], np.int32)
    found = entries([6, 7, 8, 9], [-0.1, -0.2, -0.3, -0.4])
    got = _response_logprobs(found, 2, response, np.array([1, 0, 1], np.uint8), 0)
    np.testing.assert_allclose(got, [-0.2, 0.0, -0.4])
    assert got.dtype == np.float32
    assert len(prompt) == 2


@pytest.mark.parametrize(
    ("found", "match"),
    [
        (entries([6, 7, 8], [-0.1, -0.2, -0.3]), "prompt_logprobs for 5 tokens"),
        (entries([6, 7, 8, 99], [-0.1, -0.2, -0.3, -0.4]), "'9'"),  # another token's entry
        (entries([6, 7, 8, 9], [-0.1, -0.2, float("nan"), -0.4]), "not finite"),
        (entries([6, 7, 8, 9], [-0.1, -0.2, 0.5, -0.4]), "above 0"),
    ],
)
def test_an_unusable_teacher_answer_is_refused_naming_what_is_wrong(found, match):
    with pytest.raises((ValueError, KeyError), match=match):
        _response_logprobs(found, 2, np.array([7, 8, 9], np.int32), np.ones(3, np.uint8), 0)


def test_the_answer_needs_one_choice_per_response_in_order():
    good = {
        "choices": [
            {"index": 1, "prompt_logprobs": [None]},
            {"index": 0, "prompt_logprobs": [None, {}]},
        ]
    }
    assert _prompt_logprobs(good, 2) == [[None, {}], [None]]
    with pytest.raises(ValueError, match="expected 3 choices"):
        _prompt_logprobs(good, 3)
    with pytest.raises(ValueError, match="no prompt_logprobs"):
        _prompt_logprobs({"choices": [{"index": 0, "prompt_logprobs": None}]}, 1)


def test_an_unreachable_scorer_fails_the_call_after_unavailable_s():
    config = ScorerConfig(model="m", url="http://127.0.0.1:9/v1", unavailable_s=1.5, retries=0)
    with ScorerClient("judge", config, None) as client:
        started = time.monotonic()
        future = client.post("completions", {"model": "m", "prompt": "x"})
        with pytest.raises(ScorerCallError, match=r"unreachable for unavailable_s=1\.5") as caught:
            future.result(timeout=30)
        assert caught.value.failure == "timeout"
        assert 1.4 <= time.monotonic() - started < 15


def test_a_served_scorer_that_never_publishes_its_address_fails_the_call(tmp_path):
    config = ScorerConfig(model="tiny-qwen2", unavailable_s=1.0)
    client = ScorerClient("teacher", config, open_location(str(tmp_path)))
    with client, pytest.raises(ScorerCallError, match=r"logs/scorer-teacher\.log"):
        client.post("completions", {}).result(timeout=30)


def test_an_external_key_comes_from_the_environment_only(monkeypatch):
    config = ScorerConfig(model="m", url="http://127.0.0.1:9/v1", key_env="JUDGE_KEY")
    monkeypatch.delenv("JUDGE_KEY", raising=False)
    with pytest.raises(ValueError, match="JUDGE_KEY, but that environment variable is not set"):
        ScorerClient("judge", config, None).open()
    with pytest.raises(ValueError, match="must name an environment variable"):
        ScorerConfig(model="m", url="http://x/v1", key_env="sk-123 secret")


def _other_tokenizer_model(tmp_path: Path) -> Path:
    """The tiny model with one token more in its tokenizer."""
    from transformers import AutoTokenizer

    source = Path(resolve_model_path("tiny-qwen2"))
    teacher = tmp_path / "teacher"
    shutil.copytree(source, teacher)
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    tokenizer.save_pretrained(teacher)
    return teacher


def test_a_teacher_with_another_tokenizer_is_refused_before_its_server_starts(tmp_path):
    source = resolve_model_path("tiny-qwen2")
    assert tokenizer_difference(source, source) is None
    teacher = _other_tokenizer_model(tmp_path)
    difference = tokenizer_difference(source, str(teacher))
    assert difference is not None
    assert "vocabulary has" in difference

    run_dir = tmp_path / "run"
    config = load_config(
        ["opd", "tiny-cpu"],
        overrides=[f"storage.run_uri={run_dir}", f"scorers.teacher.model={teacher}"],
    )
    prepare_run(config)
    started = time.monotonic()
    refused = subprocess.run(
        [sys.executable, "-m", "streamrl", "scorer", "--run", str(run_dir), "--name", "teacher"],
        cwd=ROOT, env={**os.environ}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert refused.returncode == USER_CODE_EXIT_CODE, refused.stderr[-2000:]
    assert "its tokenizer is not the policy's: the policy's vocabulary has" in refused.stderr
    assert "vllm" not in refused.stderr.lower()  # refused before the server started
    assert time.monotonic() - started < 120


def test_a_served_scorer_whose_model_is_not_there_is_refused_naming_the_field(tmp_path):
    run_dir = tmp_path / "run"
    config = load_config(
        ["opd", "tiny-cpu"],
        overrides=[f"storage.run_uri={run_dir}", f"scorers.teacher.model={tmp_path / 'nothing'}"],
    )
    prepare_run(config)
    refused = subprocess.run(
        [sys.executable, "-m", "streamrl", "scorer", "--run", str(run_dir), "--name", "teacher"],
        cwd=ROOT, env={**os.environ}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert refused.returncode == USER_CODE_EXIT_CODE, refused.stderr[-2000:]
    (line,) = [x for x in refused.stderr.splitlines() if x.startswith("error: ")]
    assert "invalid scorers.teacher.model" in line
    assert "does not exist" in line


def test_calls_queued_for_a_dead_scorer_fail_together_not_one_unavailable_s_after_another():
    config = ScorerConfig(
        model="m", url="http://127.0.0.1:9/v1", unavailable_s=1.5, retries=0, max_concurrency=1
    )
    with ScorerClient("judge", config, None) as client:
        started = time.monotonic()
        futures = [client.post("completions", {"prompt": str(i)}) for i in range(6)]
        for future in futures:
            with pytest.raises(ScorerCallError, match="unreachable"):
                future.result(timeout=60)
        assert time.monotonic() - started < 8  # not 6 × 1.5 s in a row
