"""Judging a program's tests outside the box: the harness's report read strictly, each test's
answer compared with what was expected.

The report (`streamrl.rewards.code.harness`) comes through the box's private channel, which no
process the program can reach holds; it is still read as untrusted input: only the harness's
own records are accepted — `{"started": true}`, then optionally `{"compiled": false, "error"}`,
then one record per test, in order, with the harness's statuses and fields and nothing else.
Whatever breaks that shape is the program's failure (its tests count as failed), never an
exception — except a report without its first record: then the box or the harness did not
start, an infrastructure error (`CodeSandboxError`), because no program code had run.

A report that ends early is the program's doing too (it killed or stopped the harness): its
remaining tests are `not run`, or `timeout` when the box was killed for time.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from streamrl.rewards.code.cases import CallTest, StdioTest
from streamrl.rewards.code.harness import OUT_OF_TIME, STATUSES

__all__ = ["CodeSandboxError", "TestReport", "output_digest", "read_report", "same"]

_DIGEST = re.compile(r"[0-9a-f]{64}")
_RAN_FIELDS = {"test", "status", "detail", "stdout", "head"}
_ENDED_FIELDS = {"test", "status", "detail"}
KILLED = "the program stopped the test harness"
MALFORMED = "the harness's report was malformed"


class CodeSandboxError(RuntimeError):
    """The box could not run a program's tests (it failed to start, or the harness never
    ran): an infrastructure error, not the program's fault."""


@dataclass(frozen=True)
class TestReport:
    """What the tests of one program did: `statuses[i]` of test i (passed, wrong, error,
    timeout, memory, output, skipped; `not run` when the program killed the harness before it
    or did not compile), `details[i]` a short reason; `compile_error` when it did not compile
    (no test ran)."""

    __test__ = False  # not a pytest class

    statuses: tuple[str, ...]
    details: tuple[str, ...]
    compile_error: str | None = None
    wall_s: float = 0.0

    @property
    def passed(self) -> int:
        return self.statuses.count("passed")

    @property
    def total(self) -> int:
        return len(self.statuses)

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total


def read_report(
    channel: bytes,
    stderr: bytes,
    tests: Sequence[StdioTest | CallTest],
    *,
    timed_out: bool,
    wall_s: float,
) -> TestReport:
    """The tests' statuses from the harness's report (module docstring). `timed_out`: the box
    was killed at its wall clock; `stderr`: the box's, for the error when nothing started.

    Raises:
        CodeSandboxError: the report lacks its first record (the harness never started).
    """
    count = len(tests)
    records = _records(channel)
    if not records or records[0] != {"started": True}:
        said = stderr.decode(errors="replace").strip().splitlines()[-1:] or ["nothing"]
        why = "in its time" if timed_out else "in the box"
        raise CodeSandboxError(f"the code harness did not start {why}; it said: {said[0]}")
    records = records[1:]
    if records and records[0] is not None and records[0].get("compiled") is False:
        if records[0].keys() != {"compiled", "error"} or not isinstance(records[0]["error"], str):
            return _failed(count, MALFORMED, wall_s)
        return TestReport(("not run",) * count, ("",) * count, records[0]["error"], wall_s)
    if len(records) > count:
        return _failed(count, MALFORMED, wall_s)
    statuses, details = [], []
    for index, record in enumerate(records):
        if not _well_formed(record, index, tests[index]):
            break
        status, detail = _judge(tests[index], record)
        statuses.append(status)
        details.append(detail)
    else:
        status, detail = ("timeout", OUT_OF_TIME) if timed_out else ("not run", KILLED)
        left = count - len(statuses)
        return TestReport((*statuses, *[status] * left), (*details, *[detail] * left), None, wall_s)
    left = count - len(statuses)
    return TestReport(
        (*statuses, *["not run"] * left), (*details, *[MALFORMED] * left), None, wall_s
    )


def _records(channel: bytes) -> list[dict[str, Any] | None]:
    """The report's lines as JSON objects (None for a line that is not one); a last line
    without its newline was cut (the harness died writing it) and is left out."""
    lines = channel.split(b"\n")[:-1]
    records: list[dict[str, Any] | None] = []
    for line in lines:
        try:
            value = json.loads(line)
        except (ValueError, RecursionError):
            value = None
        records.append(value if isinstance(value, dict) else None)
    return records


def _well_formed(record: dict[str, Any] | None, index: int, test: StdioTest | CallTest) -> bool:
    """Whether `record` is the harness's record of test `index`: its fields, no others."""
    if record is None or record.get("status") not in STATUSES:
        return False
    number = record.get("test")
    if type(number) is not int or number != index or not isinstance(record.get("detail"), str):
        return False
    if record["status"] != "ran":
        return record.keys() == _ENDED_FIELDS
    fields = _RAN_FIELDS | ({"result"} if isinstance(test, CallTest) else set())
    return (
        record.keys() == fields
        and isinstance(record["stdout"], str)
        and _DIGEST.fullmatch(record["stdout"]) is not None
        and isinstance(record["head"], str)
        and isinstance(record.get("result", ""), str)
    )


def _judge(test: StdioTest | CallTest, record: dict[str, Any]) -> tuple[str, str]:
    """A test's status from what the harness saw the program do: it ran and printed (or
    returned) what was expected, or not; or why it did not run to its end."""
    status, detail = record["status"], record["detail"][:300]
    if status != "ran":
        return status, detail
    if isinstance(test, StdioTest):
        if record["stdout"] == output_digest(test.stdout):
            return "passed", ""
        return "wrong", f"printed {record['head'][:200]!r}"
    try:
        got = json.loads(record["result"])
        if same(got, test.expected) or (test.unwrap and same(got, test.expected[0])):
            return "passed", ""
    except (ValueError, RecursionError):  # not JSON, or nested deeper than any answer
        return "wrong", "returned something that is not a value"
    return "wrong", f"returned {record['result'][:200]}"


def _failed(count: int, why: str, wall_s: float) -> TestReport:
    return TestReport(("not run",) * count, (why,) * count, None, wall_s)


def output_digest(text: str) -> str:
    """sha256 of printed lines as compared: each stripped, leading and trailing blank lines
    dropped (the harness digests what a program printed the same way)."""
    lines = [line.strip() for line in text.strip().splitlines()]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def same(got: object, want: object) -> bool:
    """== with tuples as lists and floats to a relative tolerance of 1e-6 (absolute 1e-9)."""
    if isinstance(got, bool) or isinstance(want, bool):
        return type(got) is type(want) and got == want
    if isinstance(got, int | float) and isinstance(want, int | float):
        if isinstance(got, float) or isinstance(want, float):
            return math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9)
        return got == want
    if isinstance(got, list | tuple) and isinstance(want, list | tuple):
        return len(got) == len(want) and all(same(g, w) for g, w in zip(got, want, strict=True))
    if isinstance(got, dict) and isinstance(want, dict):
        return got.keys() == want.keys() and all(same(got[k], want[k]) for k in want)
    return got == want
