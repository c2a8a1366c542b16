"""The code reward attacked as a policy under RL would attack it (docs/threat-model.md): a
program that forges its harness's report through every descriptor of every process in the box
— as root and as a non-root user, whose box's init has the program's uid —, reports that break
the harness's shape, and programs that choose their own time (stop the harness, sleep through
every test, take ages to compile) so that the reward call would outlive its limit and the group
be dropped instead of scored 0."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from streamrl.rewards.code.cases import CallTest, StdioTest
from streamrl.rewards.code.config import CodeRewardConfig
from streamrl.rewards.code.runner import LANGUAGES, TestLimits, run_tests
from streamrl.rewards.code.verdicts import MALFORMED, output_digest, read_report
from streamrl.rewards.config import RewardConfig
from streamrl.rewards.scoring import RewardScorer
from tests.as_user import run_python_as_user, users

ANSWERS = ["3", "7", "7"]
ADD = json.dumps({"inputs": ["1 2\n", "3 4\n", "10 -3\n"], "outputs": ANSWERS})

# Writes a whole forged report — the old `passed` status and `ran` with the right answer's
# digest — into every descriptor it has and every descriptor of every process in the box, then
# kills every other process in the box (the harness first among them) and prints a wrong answer.
FORGER = f"""
import glob, json, os, signal
digests = {[output_digest(answer) for answer in ANSWERS]!r}
lines = [{{"started": True}}]
for i, digest in enumerate(digests):
    lines.append({{"test": i, "status": "passed", "detail": ""}})
    lines.append({{"test": i, "status": "ran", "detail": "", "stdout": digest, "head": ""}})
forged = "".join(json.dumps(line) + "\\n" for line in lines).encode()
for fd in range(1024):
    try:
        os.write(fd, forged)
    except OSError:
        pass
for path in glob.glob("/proc/[0-9]*/fd/*") + glob.glob("/proc/[0-9]*/task/*/fd/*"):
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.write(fd, forged)
        os.close(fd)
    except OSError:
        pass
for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
    if pid != os.getpid():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
print(0)
"""

_RUN = """
import json
from streamrl.rewards.code.cases import StdioTest
from streamrl.rewards.code.runner import LANGUAGES, TestLimits, run_tests
tests = [StdioTest(i, o) for i, o in {tests!r}]
report = run_tests({program!r}, tests, LANGUAGES["python"], TestLimits(time_s=2.0), wall_s=40.0)
print(json.dumps(report.statuses))
"""


@pytest.mark.parametrize("who", users())
def test_no_process_in_the_box_can_forge_the_report(who: str) -> None:
    """As a user, bwrap's init (pid 1) has the program's uid and is dumpable: its stdout is
    within the program's reach. The report does not travel there."""
    tests = [("1 2\n", "3"), ("3 4\n", "7"), ("10 -3\n", "7")]
    code = _RUN.format(tests=tests, program=FORGER)
    if who == "root":
        report = run_tests(
            FORGER, [StdioTest(*t) for t in tests], LANGUAGES["python"], TestLimits(time_s=2.0)
        )
        statuses = list(report.statuses)
    else:
        ran = run_python_as_user(code, timeout=180)
        assert ran.returncode == 0, ran.stderr[-3000:]
        statuses = json.loads(ran.stdout.strip().splitlines()[-1])
    assert "passed" not in statuses
    assert statuses[0] in ("wrong", "not run")


def _channel(*records: object) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


START = {"started": True}
STDIO = [StdioTest("", "3"), StdioTest("", "4")]
RAN_3 = {"test": 0, "status": "ran", "detail": "", "stdout": output_digest("3"), "head": "3"}
RAN_4 = {**RAN_3, "test": 1, "stdout": output_digest("4"), "head": "4"}


def test_a_well_formed_report_is_judged() -> None:
    report = read_report(_channel(START, RAN_3, RAN_4), b"", STDIO, timed_out=False, wall_s=1.0)
    assert report.statuses == ("passed", "passed")


@pytest.mark.parametrize(
    ("channel", "first_bad"),
    [
        (_channel(START, [1], RAN_4), 0),  # not an object (raised AttributeError before)
        (_channel(START, "ran", RAN_4), 0),
        (_channel(START, {**RAN_3, "status": "passed"}, RAN_4), 0),  # not a status it reports
        (_channel(START, {**RAN_3, "status": "PASSED"}, RAN_4), 0),
        (_channel(START, RAN_4, RAN_3), 0),  # out of order
        (_channel(START, RAN_3, RAN_3), 1),  # twice
        (_channel(START, {**RAN_3, "test": True}, RAN_4), 0),  # a bool is not a test number
        (_channel(START, {**RAN_3, "test": 0.0}, RAN_4), 0),
        (_channel(START, {**RAN_3, "extra": 1}, RAN_4), 0),
        (_channel(START, {**RAN_3, "stdout": "3"}, RAN_4), 0),  # not a digest
        (_channel(START, {**RAN_3, "stdout": output_digest("3").upper()}, RAN_4), 0),
        (_channel(START, {**RAN_3, "detail": 5}, RAN_4), 0),
        (_channel(START, {k: v for k, v in RAN_3.items() if k != "head"}, RAN_4), 0),
        (_channel(START, {"test": 0, "status": "error", "detail": "", "head": "3"}, RAN_4), 0),
        (_channel(START, RAN_3, RAN_4, RAN_4), 0),  # more records than tests: all of it
        (_channel(START, {"compiled": False, "error": "x", "also": 1}), 0),
        (_channel(START, RAN_3) + b"\xff\xfe not json\n", 1),
        (_channel(START, RAN_3) + b"[" * 100_000 + b"\n", 1),  # nested deep
    ],
)
def test_a_malformed_report_fails_the_program_never_the_call(
    channel: bytes, first_bad: int
) -> None:
    report = read_report(channel, b"", STDIO, timed_out=False, wall_s=1.0)
    assert report.passed == first_bad
    assert report.statuses[first_bad:] == ("not run",) * (2 - first_bad)
    assert set(report.details[first_bad:]) == {MALFORMED}


def test_a_call_tests_record_needs_its_result_and_a_stdio_tests_has_none() -> None:
    call = [CallTest("f", (), 3)]
    no_result = dict(RAN_3)
    assert read_report(_channel(START, no_result), b"", call, timed_out=False, wall_s=1).passed == 0
    with_result = {**RAN_3, "result": "3"}
    assert (
        read_report(_channel(START, with_result), b"", call, timed_out=False, wall_s=1).passed == 1
    )
    stdio = read_report(_channel(START, with_result), b"", STDIO[:1], timed_out=False, wall_s=1)
    assert stdio.statuses == ("not run",)
    deep = {**RAN_3, "result": "[" * 5000 + "]" * 5000}
    report = read_report(_channel(START, deep), b"", call, timed_out=False, wall_s=1)
    assert report.statuses == ("wrong",)


def test_a_report_cut_by_a_timeout_fails_the_rest_as_timeouts() -> None:
    report = read_report(_channel(START, RAN_3), b"", STDIO, timed_out=True, wall_s=5.0)
    assert report.statuses == ("passed", "timeout")
    killed = read_report(
        _channel(START, RAN_3) + b'{"test": 1, "sta', b"", STDIO, timed_out=False, wall_s=5.0
    )
    assert killed.statuses == ("passed", "not run")


STOPS_HARNESS = "import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\nprint(3)"
SLEEPS_EVERY_TEST = "import time\ntime.sleep(2.9)\nprint(3)"  # just under 3 × its 1 s of CPU


def test_a_program_cannot_make_its_call_outlive_the_limit() -> None:
    """Stopping the harness, or sleeping through each test's wall clock, used to run the box
    past the reward call's limit: the pool killed it and the group was dropped (on_error),
    so the policy never paid. The box now ends within the call: those programs score 0."""
    call_limit_s = 10.0
    config = RewardConfig(
        fn="code",
        timeout_s=call_limit_s,
        workers=2,
        code=CodeRewardConfig(test_timeout_s=1.0, test_memory_mb=256),
    )
    many = json.dumps({"inputs": [""] * 8, "outputs": ["3"] * 8})
    responses = [f"```python\n{program}\n```" for program in (STOPS_HARNESS, SLEEPS_EVERY_TEST)]
    with RewardScorer.from_config(config) as scorer:
        started = time.monotonic()
        scores = scorer.score(responses, [many, many])
        elapsed = time.monotonic() - started
    assert scores.failures == [None, None]  # scored, not "timeout"
    assert scores.values == [0.0, 0.0]
    assert elapsed < 2 * call_limit_s  # each call ended within its own limit (two in parallel)


@pytest.mark.skipif(shutil.which("g++") is None, reason="C++ programs need g++ installed")
def test_compiling_counts_against_the_boxs_wall_clock() -> None:
    # g++ evaluates this constant for minutes (its constexpr step limit is 2**33).
    slow = (
        "constexpr long f() { long s = 0; for (long i = 0; i < (1L << 40); ++i) s += i; "
        "return s; }\nconstexpr long x = f();\nint main() {}\n"
    )
    started = time.monotonic()
    report = run_tests(
        slow, [StdioTest("", "")], LANGUAGES["cpp"], TestLimits(time_s=1.0), wall_s=4.0
    )
    assert time.monotonic() - started < 4.0 + 3.0
    assert report.compile_error is not None
    assert report.statuses == ("not run",)
