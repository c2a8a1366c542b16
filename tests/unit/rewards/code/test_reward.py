"""The `code` reward (docs/algorithms.md "Code reward") on real programs in the box: the
program a response wrote, each test kind, `all` and `fraction`, every way a program fails a
test, tests that cannot see each other, a program that attacks the harness, a compiled
language, and the box's failure as an infrastructure error rather than the policy's zero."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from streamrl.isolation.box import BoxUnavailableError
from streamrl.rewards.code import reward as code_reward_module
from streamrl.rewards.code import runner
from streamrl.rewards.code.cases import StdioTest
from streamrl.rewards.code.config import CodeRewardConfig
from streamrl.rewards.code.reward import CodeReward, extract_program
from streamrl.rewards.code.runner import LANGUAGES, WALL_PER_CPU, TestLimits, run_tests
from streamrl.rewards.code.verdicts import CodeSandboxError, read_report
from streamrl.rewards.config import RewardConfig
from streamrl.rewards.registry import RewardResolutionError, RewardSpec, resolve_reward
from streamrl.rewards.scoring import RewardScorer

ADD_STDIO = json.dumps({"inputs": ["1 2\n", "3 4\n", "10 -3\n"], "outputs": ["3\n", "7\n", "7"]})
ADD_CALL = json.dumps(
    {"inputs": [[1, 2], [3, 4], [0.1, 0.2]], "outputs": [[3], [7], [0.3]], "fn_name": "add"}
)
FAST = CodeRewardConfig(test_timeout_s=1.0, test_memory_mb=256)


def fenced(source: str, tag: str = "python") -> str:
    return f"Here is my solution.\n```{tag}\n{source}\n```\nIt reads the input."


def reward(score: str = "all") -> CodeReward:
    return CodeReward(FAST.model_copy(update={"score": score}), call_limit_s=30.0)


def test_the_last_program_block_is_the_program() -> None:
    response = "```python\nprint(1)\n```\ntext\n```output\n1\n```\n```py\nprint(2)\n```\n"
    program = extract_program(response)
    assert program is not None
    assert (program.source, program.language.name) == ("print(2)\n", "python")
    assert extract_program("```\nprint(3)\n```", default="cpp").language.name == "cpp"
    assert extract_program("```python\nprint(4)").source == "print(4)"  # left open at the end
    assert extract_program("no code here, ```text\n42\n```") is None


@pytest.mark.parametrize(
    ("source", "ground_truth"),
    [
        ("a, b = map(int, input().split())\nprint(a + b)", ADD_STDIO),
        ("import sys\nfor line in sys.stdin:\n    print(sum(map(int, line.split())))", ADD_STDIO),
        ("def add(a, b):\n    return a + b", ADD_CALL),
        ("class Solution:\n    def add(self, a, b):\n        return a + b", ADD_CALL),
        ("def add(a, b):\n    return (a + b,)", ADD_CALL),  # a tuple compares as a list
    ],
)
def test_a_correct_program_scores_one(source: str, ground_truth: str) -> None:
    assert reward()(fenced(source), ground_truth) == 1.0


def test_all_stops_at_the_first_failure_and_fraction_counts_every_test() -> None:
    wrong_last = fenced("a, b = map(int, input().split())\nprint(a + b if a < 10 else 0)")
    assert reward("all")(wrong_last, ADD_STDIO) == 0.0
    assert reward("fraction")(wrong_last, ADD_STDIO) == pytest.approx(2 / 3)
    # Under all, a test that does not run to its end stops the rest; answers are judged outside
    # the box, after all have run.
    crashes = reward("all").report(fenced("raise SystemExit(3)"), ADD_STDIO)
    assert crashes.statuses == ("error", "skipped", "skipped")
    assert reward("all").report(fenced("print(0)"), ADD_STDIO).statuses == ("wrong",) * 3


def test_no_program_scores_zero_without_running_anything() -> None:
    assert reward().report("the answer is 3", ADD_STDIO) is None
    assert reward()("the answer is 3", ADD_STDIO) == 0.0


@pytest.mark.parametrize(
    ("source", "status"),
    [
        ("print(3)\nprint(4)", "wrong"),
        ("raise ValueError('no')", "error"),
        ("import sys\nsys.exit(2)", "error"),
        ("while True:\n    pass", "timeout"),
        ("import time\ntime.sleep(30)", "timeout"),
        ("x = bytearray(2**30)", "memory"),
        ("while True:\n    print('x' * 4096)", "output"),
        ("def add(a, b)\n    return a + b", "not run"),  # a syntax error: nothing runs
    ],
)
def test_each_way_a_program_fails(source: str, status: str) -> None:
    report = reward("fraction").report(
        fenced(source), json.dumps({"inputs": ["1 2\n"], "outputs": ["3"]})
    )
    assert report.statuses == (status,)
    assert report.passed == 0


def test_a_test_cannot_see_what_an_earlier_one_left() -> None:
    leaves_traces = """
import os, subprocess, sys
seen = os.path.exists("/tmp/mark") or os.environ.get("MARK") or globals().get("mark")
open("/tmp/mark", "w").write("x")
os.environ["MARK"] = "1"
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
a, b = map(int, input().split())
print(999 if seen else a + b)
"""
    report = reward("fraction").report(fenced(leaves_traces), ADD_STDIO)
    assert report.statuses == ("passed", "passed", "passed")


def test_a_program_that_kills_the_harness_fails_its_tests() -> None:
    kills = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)"
    report = reward("fraction").report(fenced(kills), ADD_STDIO)
    assert report.statuses == ("not run",) * 3
    assert reward("fraction")(fenced(kills), ADD_STDIO) == 0.0


def test_no_expected_output_is_within_the_programs_reach() -> None:
    """The program shares the harness's process and files: what it could read there holds
    the tests' inputs, never their answers."""
    snoops = """
import gc, os, sys
parts = [open("/box/spec.json").read()]
frame = sys._getframe()
while frame is not None:
    parts.append(repr(frame.f_locals))
    frame = frame.f_back
parts.append(repr([o for o in gc.get_objects() if isinstance(o, (dict, list))]))
parts += [open(os.path.join("/box", name), errors="replace").read() for name in os.listdir("/box")]
print("LEAKED" if "".join(["SECRET", "-ANSWER"]) in "".join(parts) else "clean")
"""
    tests = [StdioTest("1 2\n", "SECRET-ANSWER-1\n"), StdioTest("3 4\n", "SECRET-ANSWER-2\n")]
    report = run_tests(snoops, tests, LANGUAGES["python"], TestLimits(time_s=5.0))
    assert report.statuses == ("wrong", "wrong")
    assert report.details == ("printed 'clean\\n'",) * 2


def test_a_compiled_language_plugs_in_through_the_table() -> None:
    """Where g++ is installed a C++ program compiles and runs in the box; where it is not, the
    reward refuses C++ naming what to install (never a silent zero)."""
    if shutil.which("g++") is None:
        with pytest.raises(ValueError, match=r"needs /usr/bin/g\+\+, which is not installed"):
            reward()(fenced("int main() {}", "cpp"), ADD_STDIO)
        return
    source = (
        "#include <iostream>\nint main() { long a, b; std::cin >> a >> b; std::cout << a + b; }"
    )
    assert reward()(fenced(source, "cpp"), ADD_STDIO) == 1.0
    report = reward().report(fenced("int main( {", "cpp"), ADD_STDIO)
    assert report.compile_error is not None
    assert report.statuses == ("not run",) * 3


def test_tests_past_the_boxs_wall_clock_time_out_unrun() -> None:
    report = run_tests(
        "import time\ntime.sleep(0.6)\nprint(3)",
        [StdioTest("", "3")] * 12,
        LANGUAGES["python"],
        TestLimits(time_s=1.0),
        wall_s=4.0,
    )
    assert report.statuses[:2] == ("passed", "passed")
    assert report.statuses[-1] == "timeout"
    assert report.wall_s < 4.0 + 2.0  # killed from outside at 4 s at the latest


def test_a_tests_limit_is_cpu_time_and_waiting_has_a_wall_clock_backstop() -> None:
    """A program's reward does not depend on how busy the machine is: a test may wait (here it
    sleeps) past its limit as long as it computes less than it, up to `WALL_PER_CPU` times the
    limit of wall clock; one that computes past the limit times out even when it finishes
    before the kernel's whole-second CPU limit stops it."""
    limits = TestLimits(time_s=0.5)
    sleeps = "import time\ntime.sleep(0.9)\nprint(3)"
    computes = (
        "import time\nt = time.process_time()\n"
        "while time.process_time() - t < 0.7:\n    pass\nprint(3)"
    )
    sleeps_long = "import time\ntime.sleep(5)\nprint(3)"
    python, test = LANGUAGES["python"], [StdioTest("", "3")]
    assert run_tests(sleeps, test, python, limits).statuses == ("passed",)
    computed = run_tests(computes, test, python, limits)
    assert computed.statuses == ("timeout",)
    assert computed.details == ("used more than 0.5s of CPU",)
    waited = run_tests(sleeps_long, test, python, limits)
    assert waited.statuses == ("timeout",)
    assert waited.details == (f"ran past {0.5 * WALL_PER_CPU:g}s of wall clock",)


def test_programs_run_at_the_reward_workers_lower_priority() -> None:
    """`generator.reward.nice`: the reward's workers, and the programs they run in the box,
    run that many steps below the scorer's CPU priority."""
    expected = min(19, os.nice(0) + 7)
    config = RewardConfig(fn="code", nice=7, code=FAST)
    prints_priority = fenced("import os\nprint(os.nice(0))")
    with RewardScorer.from_config(config) as scorer:
        scores = scorer.score(
            [prints_priority], [json.dumps({"inputs": [""], "outputs": [str(expected)]})]
        )
    assert scores.values == [1.0]


def test_a_box_that_cannot_start_is_an_infrastructure_error(monkeypatch) -> None:
    def refused(*args: object, **kwargs: object) -> None:
        raise BoxUnavailableError("bubblewrap is not installed; run scripts/setup.sh")

    monkeypatch.setattr(runner, "run_in_box", refused)
    with pytest.raises(CodeSandboxError, match="bubblewrap is not installed"):
        reward()(fenced("print(3)"), ADD_STDIO)


def test_a_harness_that_never_started_is_an_infrastructure_error() -> None:
    with pytest.raises(CodeSandboxError, match="did not start"):
        read_report(
            b"", b"python: cannot open file", [StdioTest("", "")], timed_out=False, wall_s=0.1
        )
    two = [StdioTest("", "")] * 2
    started = read_report(b'{"started": true}\n', b"", two, timed_out=False, wall_s=0.1)
    assert started.statuses == ("not run",) * 2


def test_the_registered_reward_takes_its_settings_and_checks_the_machine(monkeypatch) -> None:
    loaded = resolve_reward(RewardSpec("code", FAST.model_copy(update={"score": "fraction"}), 20.0))
    assert isinstance(loaded, CodeReward)
    assert loaded.settings.score == "fraction"
    assert loaded.wall_s == pytest.approx(20.0 * 0.95 - 1.0)
    monkeypatch.setitem(
        runner.LANGUAGES, "python", LANGUAGES["python"].__class__(
            "python", ("python",), "main.py", needs=("/nonexistent/python9",)
        ),
    )  # fmt: skip
    with pytest.raises(RewardResolutionError, match="needs /nonexistent/python9"):
        resolve_reward(RewardSpec("code"))
    assert code_reward_module.LANGUAGES is runner.LANGUAGES
