"""Tests for `streamrl.rewards`: math answer verification, the format reward, the registry and
the process-isolated scorer (real spawned workers; user functions in tests/reward_fns.py)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from streamrl.isolation.user_code import modules_not_found
from streamrl.rewards import (
    REWARD_FUNCTIONS,
    RewardLoadError,
    RewardResolutionError,
    RewardScorer,
    RewardValueError,
    check_reward_name,
    check_score,
    format_reward,
    math_format_reward,
    math_reward,
    registered_rewards,
    resolve_reward,
)
from tests import reward_fns

SCRIPTED = "tests.reward_fns:scripted"

# --------------------------------------------------------------------------------------------
# Math verification
# --------------------------------------------------------------------------------------------

MATH_CASES = [
    # (response, ground truth, correct?)
    ("The answer is \\boxed{12}.", "12", True),
    ("Answer: 12", "12", True),
    ("the answer is 12", "12", True),
    ("**Answer:** 12", "12", True),
    ("First 5, then 7, so we get 12", "12", True),  # last number, no anchor
    ("Answer: 13", "12", False),
    ("We get 12 so the answer is 13", "12", False),  # the stated answer wins over a number
    ("\\boxed{12} but on reflection \\boxed{13}", "12", False),  # the last box wins
    ("\\boxed{12}", "12.0", True),
    # fractions and decimals
    ("So it is 0.5", "\\frac{1}{2}", True),
    ("\\boxed{\\frac{1}{2}}", "0.5", True),
    ("I think 1/2", "0.5", True),
    ("Answer: 2/4", "1/2", True),
    ("\\boxed{\\frac12}", "1/2", True),
    ("The final answer is $\\boxed{\\dfrac{1}{2}}$", "0.5", True),
    ("\\boxed{0.333333}", "\\frac13", True),
    ("\\boxed{0.33}", "1/3", False),
    ("\\boxed{12.5}", "25/2", True),
    # negative numbers
    ("Answer: -3", "-3", True),
    ("$-\\frac{3}{2}$", "-1.5", True),
    ("Answer: -7", "7", False),
    ("\\boxed{-3}", "3", False),
    # LaTeX expressions
    ("\\boxed{x^2+1}", "1+x^2", True),
    ("\\boxed{(x+1)^2}", "x^2+2x+1", True),
    ("\\boxed{x^2}", "x^3", False),
    ("$\\sqrt{8}$", "2\\sqrt{2}", True),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", True),
    ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}", True),
    ("\\boxed{1.5708}", "\\frac{\\pi}{2}", False),  # a rounded decimal is not π/2
    ("\\boxed{(1,2)}", "(1,2)", True),
    ("\\boxed{x=4}", "4", True),
    # thousands separators, units, currency, percent
    ("Answer: 1,000", "1000", True),
    ("\\boxed{1000}", "1,000", True),
    ("The answer is 1,234,567", "1234567", True),
    ("Answer: 1,000,000", "10^6", True),
    ("The answer is 5 cm", "5", True),
    ("The answer is \\boxed{5\\text{ cm}}", "5", True),
    ("Answer: $5", "5", True),
    ("50%", "50\\%", True),
    # a ground truth with its own delimiters
    ("12", "$12$", True),
    # no answer at all
    ("I don't know", "12", False),
    ("", "12", False),
]


@pytest.mark.parametrize(("response", "ground_truth", "correct"), MATH_CASES)
def test_math_reward(response: str, ground_truth: str, correct: bool) -> None:
    assert math_reward(response, ground_truth) == (1.0 if correct else 0.0)


@pytest.mark.parametrize("ground_truth", ["", "   ", "\\boxed{}"])
def test_math_reward_rejects_a_ground_truth_that_is_no_answer(ground_truth: str) -> None:
    with pytest.raises(ValueError, match=r"data\.answer_field"):
        math_reward("Answer: 12", ground_truth)


FORMAT_CASES = [
    ("so the answer is \\boxed{12}.", 1.0),
    ("Answer: 12", 1.0),
    ("Final answer: 12", 1.0),
    ("**Answer:** 12", 1.0),
    ("**Answer**: x+1", 1.0),
    ("working...\nANSWER: 7", 1.0),
    ("Answer: \\boxed{12}", 1.0),  # one answer, stated in both forms at once
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", 1.0),  # nested braces
    ("\\boxed{\\{1, 2\\}}", 1.0),  # escaped braces do not count
    ("\\boxed { 3 }", 1.0),
    ("the answer is 12", 0.0),  # no recognised form
    ("", 0.0),
    ("\\boxed{12} and \\boxed{13}", 0.0),  # two answers
    ("Answer: 12\nAnswer: 13", 0.0),
    ("Answer: 12\nso \\boxed{12}\nAnswer: 12", 0.0),
    ("\\boxed{12", 0.0),  # unclosed
    ("\\boxed{\\frac{1}{2}", 0.0),
    ("\\boxed 5", 0.0),  # no brace group
    ("\\boxed{  }", 0.0),  # empty
    ("Answer:", 0.0),
    ("Answer:\n12", 0.0),  # the value must be on the Answer line
    ("The answers are below: 1, 2", 0.0),
]


@pytest.mark.parametrize(("response", "expected"), FORMAT_CASES)
def test_format_reward(response: str, expected: float) -> None:
    assert format_reward(response, "unused") == expected


@pytest.mark.parametrize(
    ("response", "ground_truth", "expected"),
    [
        ("Answer: 12", "12", 1.0),
        ("so \\boxed{1/2}", "0.5", 1.0),
        ("the answer is 12", "12", 0.0),  # correct, but not in a recognised form
        ("Answer: 13", "12", 0.0),  # well formed, wrong
        ("\\boxed{12} \\boxed{12}", "12", 0.0),
    ],
)
def test_math_format_reward(response: str, ground_truth: str, expected: float) -> None:
    assert math_format_reward(response, ground_truth) == expected


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------


def test_registered_names_resolve_to_their_functions() -> None:
    assert registered_rewards() == ["code", "format", "math", "math_format", "reasoning_gym"]
    assert resolve_reward("math") is math_reward
    assert resolve_reward("format") is format_reward
    assert resolve_reward("math_format") is math_format_reward
    assert set(REWARD_FUNCTIONS) | {"code"} == set(registered_rewards())


def test_user_function_by_import_path() -> None:
    fn = resolve_reward(SCRIPTED)
    assert fn is reward_fns.scripted
    assert fn("7", "7", prompt=None) is True


def test_user_function_without_prompt_is_called_without_it() -> None:
    fn = resolve_reward("tests.reward_fns:without_prompt")
    assert fn(" 7", "7", prompt="ignored") == 1.0
    assert fn("8", "7") == 0.0


def test_unknown_name_lists_registered_and_suggests_closest() -> None:
    with pytest.raises(RewardResolutionError, match="unknown reward 'mathh'") as info:
        resolve_reward("mathh")
    message = str(info.value)
    assert "did you mean 'math'?" in message
    assert "format, math, math_format" in message
    assert "package.module:function" in message


def test_dotted_name_without_colon_hints_the_import_path_form() -> None:
    with pytest.raises(RewardResolutionError, match=r"'tests\.reward_fns:scripted'"):
        resolve_reward("tests.reward_fns.scripted")


def test_missing_module() -> None:
    with pytest.raises(RewardResolutionError, match="no module named 'no_such_pkg'"):
        resolve_reward("no_such_pkg.rewards:score")


def test_missing_attribute_suggests_closest() -> None:
    with pytest.raises(RewardResolutionError, match="has no attribute 'scriptd'") as info:
        resolve_reward("tests.reward_fns:scriptd")
    assert "did you mean 'tests.reward_fns:scripted'?" in str(info.value)


def test_not_callable() -> None:
    with pytest.raises(RewardResolutionError, match=r"is not callable \(it is the int 42\)"):
        resolve_reward("tests.reward_fns:NOT_CALLABLE")


def test_wrong_parameters() -> None:
    with pytest.raises(RewardResolutionError, match=r"has parameters \(response\)"):
        resolve_reward("tests.reward_fns:one_argument")


def test_module_whose_import_fails(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "needs_dep.py").write_text("import not_installed_dep\n\ndef r(a, b): return 1\n")
    (tmp_path / "raises_on_import.py").write_text("raise RuntimeError('bad module')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardResolutionError, match="imports 'not_installed_dep'"):
        resolve_reward("needs_dep:r")
    with pytest.raises(RewardResolutionError, match="RuntimeError: bad module"):
        resolve_reward("raises_on_import:r")


def test_what_fails_the_same_way_every_time_is_no_load_error(tmp_path, monkeypatch) -> None:
    """A generator is not restarted on a resolution error (the name, module or function is not
    there); one whose module raised on import may import next time (`RewardLoadError`)."""
    (tmp_path / "needs_dep.py").write_text("import not_installed_dep\n")
    (tmp_path / "raises_on_import.py").write_text("raise OSError('share not mounted')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for fn in ("no_such_pkg.rewards:score", "needs_dep:r", "tests.reward_fns:scriptd", "mathh"):
        with pytest.raises(RewardResolutionError) as error:
            resolve_reward(fn)
        assert not isinstance(error.value, RewardLoadError), fn
    with pytest.raises(RewardLoadError, match="OSError: share not mounted"):
        resolve_reward("raises_on_import:r")


@pytest.mark.parametrize(
    ("value", "expected"),
    [(True, 1.0), (False, 0.0), (1, 1.0), (0.25, 0.25), (np.float32(0.5), 0.5), (np.bool_(1), 1.0)],
)
def test_check_score_accepts_scores(value: object, expected: float) -> None:
    assert check_score(value, "r") == expected


NOT_SCORES = [1.5, -0.1, float("nan"), float("inf"), -float("inf"), np.float64("inf"), 10**400]


@pytest.mark.parametrize("value", [*NOT_SCORES, "1", None, np.array([1.0])])
def test_check_score_rejects_other_values(value: object) -> None:
    with pytest.raises(RewardValueError, match=r"must return a score in \[0, 1\] or a bool"):
        check_score(value, "r")


def test_check_reward_name_imports_no_user_code(tmp_path, monkeypatch) -> None:
    (tmp_path / "loud_module.py").write_text("raise RuntimeError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    check_reward_name("math")
    check_reward_name("loud_module:reward")  # found out by the workers, not here
    assert "loud_module" not in sys.modules
    with pytest.raises(RewardResolutionError, match="did you mean 'math'"):
        check_reward_name("maht")
    with pytest.raises(RewardResolutionError, match=r"must look like 'package\.module:function'"):
        check_reward_name("loud_module:")


def test_modules_are_looked_for_without_importing_them(tmp_path, monkeypatch) -> None:
    (tmp_path / "loud_module.py").write_text("raise RuntimeError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    paths = {"generator.reward.fn": "loud_module:reward", "generator.env.fn": "lodu_module.x:E"}
    (problem,) = modules_not_found(paths)
    assert problem.startswith("generator.env.fn: no module named 'lodu_module'")
    assert "loud_module" not in sys.modules
    workdir = tmp_path / "workdir"  # `python -m` puts the working directory first on the path
    workdir.mkdir()
    (workdir / "in_the_workdir.py").write_text("raise RuntimeError('imported')\n")
    monkeypatch.chdir(workdir)
    assert modules_not_found({"generator.reward.fn": "in_the_workdir:reward"}) == []
    assert "in_the_workdir" not in sys.modules


# --------------------------------------------------------------------------------------------
# Scorer (spawned worker processes)
# --------------------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_scorer_checks_arguments_before_starting_workers() -> None:
    with pytest.raises(RewardResolutionError, match="did you mean 'math'"):
        RewardScorer("maht")
    scorer = RewardScorer("math")
    with pytest.raises(ValueError, match=r"one ground truth .* per response"):
        scorer.score(["a", "b"], ["a"])
    with pytest.raises(RuntimeError, match="not open"):
        scorer.score(["a"], ["a"])


def test_a_reward_the_workers_cannot_resolve_fails_on_entry_in_resolve_rewards_words(
    tmp_path, monkeypatch
) -> None:
    (tmp_path / "raises_on_import.py").write_text("raise RuntimeError('bad module')\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the spawned workers inherit sys.path
    cases = {
        "no_such_pkg.rewards:score": "no module named 'no_such_pkg'",
        "tests.reward_fns:scriptd": "did you mean 'tests.reward_fns:scripted'",
        "raises_on_import:r": "RuntimeError: bad module",
    }
    for fn, message in cases.items():
        scorer = RewardScorer(fn, workers=2, timeout_s=10.0)  # nothing imported yet
        with pytest.raises(RewardResolutionError, match=message), scorer:
            pass
        assert "raises_on_import" not in sys.modules


def test_math_scorer_scores_in_order_and_stops_its_workers_on_exit() -> None:
    responses = ["Answer: 12", "\\boxed{\\frac{1}{2}}", "no idea", "The answer is -3", "13"]
    truths = ["12", "0.5", "7", "-3", "12"]
    with RewardScorer("math", workers=2, timeout_s=10.0) as scorer:
        pids = scorer.worker_pids
        assert len(pids) == 2
        assert all(_alive(pid) for pid in pids)
        scores = scorer.score(responses, truths, prompts=["p"] * 5)
        assert scores.values == [1.0, 1.0, 0.0, 1.0, 0.0]
        assert scores.failures == [None] * 5
        assert not scores.any_failed
        assert scorer.score([], []).values == []
    assert scorer.stats.calls == 5
    assert (scorer.stats.timeouts, scorer.stats.errors) == (0, 0)
    assert not any(_alive(pid) for pid in pids)
    assert not {p.pid for p in multiprocessing.active_children()} & set(pids)


def test_failing_calls_score_zero_are_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    batch = {  # response: (ground truth, score, failure)
        "7": ("7", 1.0, None),
        "raise": ("7", 0.0, "error"),
        "8": ("7", 0.0, None),  # wrong, not failed
        "return:1.5": ("7", 0.0, "error"),
        "return:text": ("7", 0.0, "error"),
        "return:nan": ("7", 0.0, "error"),
        "return:inf": ("7", 0.0, "error"),
        "return:none": ("7", 0.0, "error"),
        "return:true": ("7", 1.0, None),
        "prompt": ("p", 1.0, None),
    }
    responses = list(batch)
    truths = [truth for truth, _, _ in batch.values()]
    caplog.set_level(logging.WARNING, logger="streamrl.rewards.scoring")
    with RewardScorer(SCRIPTED, workers=2, timeout_s=10.0) as scorer:
        scores = scorer.score(responses, truths, prompts=["p"] * len(responses))
    assert scores.values == [expected for _, expected, _ in batch.values()]
    assert scores.failures == [failure for _, _, failure in batch.values()]
    assert (scores.errors, scores.timeouts, scores.any_failed) == (6, 0, True)
    assert (scorer.stats.errors, scorer.stats.timeouts, scorer.stats.pool_restarts) == (6, 0, 0)
    assert "ValueError: boom" in caplog.text
    assert "returned 1.5 of type float" in caplog.text
    assert "returned 'yes' of type str" in caplog.text
    assert "returned None of type NoneType" in caplog.text
    assert "returned inf of type float" in caplog.text


def test_hung_call_is_killed_at_the_timeout_and_later_calls_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="streamrl.rewards.scoring")
    timeout_s = 2.0
    with RewardScorer(SCRIPTED, workers=2, timeout_s=timeout_s) as scorer:
        old_pids = scorer.worker_pids
        # 'hang' and the first 'sleep:1.3' start together; the second sleep starts at ~1.3 s and
        # is still running, within its own limit, when the hang is cut at 2 s: it must be
        # scored again on the new workers, not lost or counted as a timeout.
        responses = ["hang", "sleep:1.3", "sleep:1.3", "7"]
        started = time.monotonic()
        scores = scorer.score(responses, ["hang", "sleep:1.3", "sleep:1.3", "7"])
        elapsed = time.monotonic() - started
        assert scores.values == [0.0, 1.0, 1.0, 1.0]
        assert scores.failures == ["timeout", None, None, None]
        assert timeout_s <= elapsed < 30.0
        assert (scorer.stats.timeouts, scorer.stats.errors, scorer.stats.pool_restarts) == (1, 0, 1)
        assert "exceeded timeout_s=2" in caplog.text
        assert not any(_alive(pid) for pid in old_pids)  # the stuck worker is gone
        new_pids = scorer.worker_pids
        assert len(new_pids) == 2
        assert not set(new_pids) & set(old_pids)

        started = time.monotonic()
        assert scorer.score(["7", "8", "7", "7"], ["7"] * 4).values == [1.0, 0.0, 1.0, 1.0]
        assert time.monotonic() - started < timeout_s
    assert scorer.stats.timeouts == 1
    assert not any(_alive(pid) for pid in new_pids)


def test_worker_that_dies_scores_zero_and_the_pool_is_replaced() -> None:
    with RewardScorer(SCRIPTED, workers=2, timeout_s=10.0) as scorer:
        old_pids = scorer.worker_pids
        crashed = scorer.score(["crash"], ["crash"])
        assert (crashed.values, crashed.failures) == ([0.0], ["error"])
        assert (scorer.stats.errors, scorer.stats.pool_restarts) == (1, 1)
        assert not any(_alive(pid) for pid in old_pids)
        assert scorer.score(["7", "8"], ["7", "7"]).values == [1.0, 0.0]


def test_concurrent_batches_from_threads_are_each_scored_in_order() -> None:
    batches = [([str(i % 3) for i in range(8)], ["0"] * 8), (["1"] * 5 + ["2"], ["1"] * 6)]
    expected = [[1.0 if i % 3 == 0 else 0.0 for i in range(8)], [1.0] * 5 + [0.0]]
    with (
        RewardScorer(SCRIPTED, workers=2, timeout_s=10.0) as scorer,
        ThreadPoolExecutor(max_workers=2) as threads,
    ):
        futures = [threads.submit(scorer.score, *batch) for batch in batches * 3]
        results = [future.result().values for future in futures]
    assert results == expected * 3
    assert scorer.stats.calls == 3 * (8 + 6)


def test_a_pool_replaced_in_a_callers_thread_outlives_that_thread() -> None:
    """Workers are killed when the thread that started them ends (their parent-death signal
    follows the thread), so the scorer starts every pool from its own thread: a caller's thread
    that hit a timeout and has ended leaves working workers behind."""
    with RewardScorer(SCRIPTED, workers=1, timeout_s=1.0) as scorer:
        caller = threading.Thread(target=scorer.score, args=(["hang"], ["hang"]))
        caller.start()
        caller.join()
        assert (scorer.stats.timeouts, scorer.stats.pool_restarts) == (1, 1)
        pids = scorer.worker_pids
        time.sleep(1.0)
        assert all(_alive(pid) for pid in pids)
        scores = scorer.score(["7"], ["7"])
        assert (scores.values, scores.failures) == ([1.0], [None])
        assert scorer.stats.pool_restarts == 1
        assert scorer.worker_pids == pids
