"""Running a program against a problem's tests in the box: one box per program, all its tests
inside it (`streamrl.rewards.code.harness`), each test in a fresh process with its own time and
memory limits.

`LANGUAGES` is the language table: how a program of each language is written to the box,
compiled (inside the box, with its own time limit) and run. Python runs in the harness's own
forked process — no interpreter start per test — and is the only language with function-call
tests; a compiled language runs its binary per test. A language whose toolchain is not
installed is refused when the reward loads (`check_language`), naming what to install.

`run_tests` returns a `TestReport`: every test's status, or that the program did not compile.
Only the tests' inputs enter the box; what the program printed or returned comes back through
the box's private channel and is judged here (`streamrl.rewards.code.verdicts`), so no expected
output is within a program's reach and no process the program can reach can write the report.

Time: the whole box — start, compiling, every test — runs within `wall_s` of wall clock, kept
from outside (the caller kills the box's init), and the harness ends its tests a moment before
(the deadline it is given). A box killed for time after the harness started is the program's
failure: its remaining tests time out. A box that could not run the harness at all raises
`CodeSandboxError` — an infrastructure error the scorer counts (`generator.reward.on_error`),
never the policy's zero.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from streamrl.isolation.box import BoxLimits, BoxUnavailableError, run_in_box
from streamrl.rewards.code.cases import CallTest, StdioTest
from streamrl.rewards.code.verdicts import CodeSandboxError, TestReport, read_report

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
_REPORT_S = 0.5  # between the harness's deadline and the box's kill: its last record
WALL_PER_CPU = 3.0  # a test's wall-clock limit, in multiples of its CPU limit


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


def run_tests(
    program: str,
    tests: Sequence[StdioTest | CallTest],
    language: Language,
    limits: TestLimits,
    *,
    wall_s: float | None = None,
    stop_on_failure: bool = False,
) -> TestReport:
    """Run `program` against `tests` in one box (module docstring), all of it within `wall_s`
    seconds of wall clock (None: what the tests' own limits add up to): tests that would start
    too late to use their CPU limit time out unrun, and the one running at the deadline is
    stopped there. With `stop_on_failure`, the tests after one that did not run to its end
    (error, timeout, memory, output) are skipped.

    Raises:
        CodeSandboxError: the box or the harness did not start.
    """
    if not language.calls_functions and any(isinstance(t, CallTest) for t in tests):
        return _not_run(tests, f"{language.name} programs take stdin tests only")
    needed = len(tests) * (limits.wall_s + _TEST_OVERHEAD_S) + _BOX_OVERHEAD_S
    if language.compile:
        needed += limits.compile_s
    wall_s = min(needed if wall_s is None else wall_s, 3600.0)
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
        "deadline": time.monotonic() + wall_s - _REPORT_S,  # the box shares this clock
        "stop_on_failure": stop_on_failure,
    }
    box = BoxLimits(
        wall_s=wall_s,
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
        result = run_in_box(["python", "/box/harness.py"], limits=box, files=files, channel=True)
    except BoxUnavailableError as error:
        raise CodeSandboxError(str(error)) from error
    return read_report(
        result.channel, result.stderr, tests, timed_out=result.timed_out, wall_s=result.wall_s
    )


def _not_run(tests: Sequence[object], why: str) -> TestReport:
    return TestReport(("not run",) * len(tests), (why,) * len(tests), why)
