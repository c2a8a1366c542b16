"""Running a program against a problem's tests in the box: one box per program, all its tests
inside it (`streamrl.rewards.code.harness`), each test in a fresh process with its own time and
memory limits.

`LANGUAGES` is the language table: how a program of each language is written to the box,
compiled (inside the box, with its own time limit) and run. Python runs in the harness's own
forked process — no interpreter start per test — and is the only language with function-call
tests; a compiled language runs its binary per test. A language whose toolchain is not
installed is refused when the reward loads (`check_language`), naming what to install.

`run_tests` returns a `TestReport`: every test's status, or that the program did not compile.
Only the tests' inputs enter the box; what the program printed or returned comes back and is
judged here (`_judge`), so no expected output is within a program's reach. A box that could not
run the harness at all raises `CodeSandboxError` — an infrastructure error the scorer counts
(`generator.reward.on_error`), never the policy's zero. Once the harness has started, whatever
the program does (crash, hang, kill the harness) fails its tests.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from streamrl.isolation.box import BoxLimits, BoxUnavailableError, run_in_box
from streamrl.rewards.code.cases import CallTest, StdioTest

__all__ = [
    "HARNESS",
    "LANGUAGES",
    "WALL_PER_CPU",
    "CodeSandboxError",
    "Language",
    "TestLimits",
    "TestReport",
    "check_language",
    "run_tests",
]

HARNESS = Path(__file__).with_name("harness.py")
_BOX_OVERHEAD_S = 5.0  # starting the box and the harness, on a loaded machine
_TEST_OVERHEAD_S = 0.5  # forking, cleaning up and reporting one test
WALL_PER_CPU = 3.0  # a test's wall-clock limit, in multiples of its CPU limit


class CodeSandboxError(RuntimeError):
    """The box could not run a program's tests (it failed to start, or the harness never
    ran): an infrastructure error, not the program's fault."""


@dataclass(frozen=True)
class Language:
    """How one language is run in the box. `fences`: the code-fence tags that name it
    (```python); `source`: the program's file name under /box; `compile`: the compiler's argv,
    run in the box's scratch directory (None: interpreted); `run`: a test's argv (None: Python
    in the harness's process); `needs`: programs that must be installed."""

    name: str
    fences: tuple[str, ...]
    source: str
    compile: tuple[str, ...] | None = None
    run: tuple[str, ...] | None = None
    needs: tuple[str, ...] = ()

    @property
    def calls_functions(self) -> bool:
        return self.run is None


LANGUAGES: dict[str, Language] = {
    "python": Language("python", ("python", "py", "python3"), "main.py"),
    "cpp": Language(
        "cpp",
        ("cpp", "c++", "cc", "cxx"),
        "main.cpp",
        compile=("/usr/bin/g++", "-O2", "-std=c++17", "-o", "/tmp/program", "/box/main.cpp"),
        run=("/tmp/program",),
        needs=("/usr/bin/g++",),
    ),
}


@functools.cache
def _installed(program: str) -> bool:
    """Whether `program` is there: looked up once per process (every reward call checks its
    program's language)."""
    return shutil.which(program) is not None


def check_language(name: str) -> Language:
    """The language `name` names, its toolchain installed.

    Raises:
        ValueError: an unknown language, or one whose toolchain is missing (named).
    """
    if name not in LANGUAGES:
        raise ValueError(f"code language {name!r} is not one of {sorted(LANGUAGES)}")
    language = LANGUAGES[name]
    missing = [program for program in language.needs if not _installed(program)]
    if missing:
        raise ValueError(
            f"code language {name!r} needs {', '.join(missing)}, which is not installed on "
            "this machine; install its toolchain (e.g. `apt-get install g++`)"
        )
    return language


@dataclass(frozen=True)
class TestLimits:
    """Each test's limits: `time_s` of CPU (and `WALL_PER_CPU` times it of wall clock, for a
    program that waits or sleeps), `memory_mb` of address space, `output_bytes` of standard
    output; `compile_s` for compiling the program.

    CPU time, not wall clock, is what a test may use: a program's reward does not depend on how
    busy the machine is (reward workers run below sampling's priority, `generator.reward.nice`)."""

    __test__ = False  # not a pytest class

    time_s: float = 4.0
    memory_mb: int = 512
    output_bytes: int = 1024**2
    compile_s: float = 30.0

    @property
    def wall_s(self) -> float:
        return self.time_s * WALL_PER_CPU


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


def run_tests(
    program: str,
    tests: Sequence[StdioTest | CallTest],
    language: Language,
    limits: TestLimits,
    *,
    budget_s: float = 3600.0,
    stop_on_failure: bool = False,
) -> TestReport:
    """Run `program` against `tests` in one box (module docstring): the tests that would start
    after `budget_s` seconds time out unrun; with `stop_on_failure`, those after one that did
    not run to its end (error, timeout, memory, output) are skipped. Answers are judged here,
    outside the box (`_judge`): the harness never sees one.

    Raises:
        CodeSandboxError: the box or the harness did not start.
    """
    if not language.calls_functions and any(isinstance(t, CallTest) for t in tests):
        return _not_run(tests, f"{language.name} programs take stdin tests only")
    spec = {
        "source": f"/box/{language.source}",
        "compile": list(language.compile) if language.compile else None,
        "run": list(language.run) if language.run else None,
        "tests": [test.as_input() for test in tests],
        "time_s": limits.time_s,
        "wall_s": limits.wall_s,
        "memory_mb": limits.memory_mb,
        "output_bytes": limits.output_bytes,
        "compile_s": limits.compile_s,
        "budget_s": budget_s,
        "stop_on_failure": stop_on_failure,
    }
    wall_s = len(tests) * (limits.wall_s + _TEST_OVERHEAD_S)
    if language.compile:
        wall_s += limits.compile_s
    wall_s = _BOX_OVERHEAD_S + min(wall_s, budget_s + limits.wall_s)
    box = BoxLimits(
        wall_s=min(wall_s, 3600.0),
        cpu_s=min(3600, math.ceil(wall_s)),
        memory_mb=limits.memory_mb + 256,  # the harness's own interpreter on top
        processes=32,
        file_mb=max(16, limits.output_bytes // 1024**2 + 1),
        scratch_mb=max(64, 2 * limits.output_bytes // 1024**2 + 16),
        output_bytes=4 * 1024**2,
    )
    files = {
        "harness.py": HARNESS.read_bytes(),
        "spec.json": json.dumps(spec).encode(),
        language.source: program.encode(),
    }
    try:
        result = run_in_box(["python", "/box/harness.py"], limits=box, files=files)
    except BoxUnavailableError as error:
        raise CodeSandboxError(str(error)) from error
    return _report(result.stdout, result.stderr, tests, result.wall_s)


def _report(
    stdout: bytes, stderr: bytes, tests: Sequence[StdioTest | CallTest], wall_s: float
) -> TestReport:
    count = len(tests)
    records = []
    for line in stdout.decode(errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a cut line: the harness died writing it
    if not records or records[0] != {"started": True}:
        said = stderr.decode(errors="replace").strip().splitlines()[-1:] or ["nothing"]
        raise CodeSandboxError(f"the code harness did not start in the box; it said: {said[0]}")
    if len(records) > 1 and records[1].get("compiled") is False:
        error = str(records[1]["error"])
        return TestReport(("not run",) * count, ("",) * count, error, wall_s)
    statuses = ["not run"] * count
    details = ["the program stopped the test harness"] * count
    for record in records[1:]:
        index = record.get("test")
        if isinstance(index, int) and 0 <= index < count:
            statuses[index], details[index] = _judge(tests[index], record)
    return TestReport(tuple(statuses), tuple(details), None, wall_s)


def _judge(test: StdioTest | CallTest, record: dict[str, object]) -> tuple[str, str]:
    """A test's status from what the harness saw the program do: it ran and printed (or
    returned) what was expected, or not; or why it did not run to its end."""
    status, detail = str(record.get("status")), str(record.get("detail", ""))
    if status != "ran":
        return status, detail
    if isinstance(test, StdioTest):
        if record.get("stdout") == output_digest(test.stdout):
            return "passed", ""
        return "wrong", f"printed {str(record.get('head', ''))!r}"
    try:
        got = json.loads(str(record.get("result")))
    except json.JSONDecodeError:
        return "wrong", "returned something that is not a value"
    if same(got, test.expected) or (test.unwrap and same(got, test.expected[0])):
        return "passed", ""
    return "wrong", f"returned {json.dumps(got)[:200]}"


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


def _not_run(tests: Sequence[object], why: str) -> TestReport:
    return TestReport(("not run",) * len(tests), (why,) * len(tests), why)
