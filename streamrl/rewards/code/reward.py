"""The `code` reward (docs/algorithms.md "Code reward"): the program is the last fenced code
block of the response, run against the problem's tests in the box.

- No code block: R = 0, a format failure of the policy.
- `score: all` (default): R = 1 when every test passes, else 0 (a test that errs, times out or
  runs out of memory ends the run of tests); `fraction`: R = passed / total.
- Answers are judged outside the box: only the tests' inputs enter it, so a program that reads
  its harness's memory or files finds no expected output there.
- A test that fails, times out, runs out of memory or prints too much counts as failed; a
  program that does not compile fails every test.
- A box that could not run the program at all raises `CodeSandboxError`: the scorer counts it
  as a failed call and `generator.reward.on_error` decides (drop the group, or score 0), so an
  infrastructure failure is never taken for the policy's.

The whole box — start-up, compiling, every test — ends within the reward call's limit
(`generator.reward.timeout_s`) with a margin (`box_wall_s`), so the call never outlives its
limit whatever the program does (sleep in every test, stop its harness): tests past that time
are the program's failures, and the policy pays for them instead of having its group dropped.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from streamrl.rewards.code.cases import read_tests
from streamrl.rewards.code.config import CodeRewardConfig
from streamrl.rewards.code.runner import LANGUAGES, Language, check_language, run_tests
from streamrl.rewards.code.verdicts import TestReport

__all__ = ["CodeReward", "Program", "box_wall_s", "extract_program"]

# ```tag ... ```: the tag is the fence's first word; a block left open at the end of the
# response (the model stopped before closing it) counts too.
_FENCE = re.compile(
    r"^[ \t]*```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)(?:^[ \t]*```[ \t]*$|\Z)", re.S | re.M
)
_CALL_MARGIN_S = 1.0  # between the box's end and the call's limit: returning the score
_CALL_MARGIN_FRACTION = 0.05  # and a share of the limit, for a loaded machine


def box_wall_s(call_limit_s: float) -> float:
    """The box's whole wall clock within a reward call of `call_limit_s` seconds."""
    return call_limit_s * (1.0 - _CALL_MARGIN_FRACTION) - _CALL_MARGIN_S


@dataclass(frozen=True)
class Program:
    """A program a response wrote, and its language."""

    source: str
    language: Language


def extract_program(response: str, default: str = "python") -> Program | None:
    """The last fenced code block of `response` whose tag names a language of the table (or
    none: `default`); None when there is none. A block tagged with another word (```text,
    ```output) is not a program."""
    for tag, body in reversed(_FENCE.findall(response)):
        language = _language(tag.lower(), default)
        if language is not None and body.strip():
            return Program(body, language)
    return None


def _language(tag: str, default: str) -> Language | None:
    if not tag:
        return LANGUAGES[default]
    return next((lang for lang in LANGUAGES.values() if tag in lang.fences), None)


class CodeReward:
    """The `code` reward with its settings (`generator.reward.code`), as a reward worker loads
    it: its language's toolchain is checked on loading. `call_limit_s`: the reward call's
    limit (`generator.reward.timeout_s`); the box's time is counted from the call's start."""

    def __init__(self, settings: CodeRewardConfig, call_limit_s: float) -> None:
        check_language(settings.language)
        self.settings = settings
        self.wall_s = box_wall_s(call_limit_s)
        if self.wall_s <= 0:
            raise ValueError(
                f"a reward call of {call_limit_s:g}s leaves the code box no time: raise "
                "generator.reward.timeout_s"
            )

    def __call__(self, response: str, ground_truth: str, *, prompt: str | None = None) -> float:
        report = self.report(response, ground_truth)
        if report is None or report.total == 0:
            return 0.0
        if self.settings.score == "fraction":
            return report.passed / report.total
        return 1.0 if report.all_passed else 0.0

    def report(
        self, response: str, ground_truth: str, *, public_only: bool = False
    ) -> TestReport | None:
        """What the response's program did on the problem's tests (the public ones only, with
        `public_only`); None when the response has no program."""
        started = time.monotonic()
        tests = read_tests(ground_truth, self.settings.layout)
        program = extract_program(response, self.settings.language)
        if program is None:
            return None
        check_language(program.language.name)
        return run_tests(
            program.source,
            tests.public if public_only else tests.all,
            program.language,
            self.settings.limits(),
            wall_s=self.wall_s - (time.monotonic() - started),
            stop_on_failure=self.settings.score == "all" and not public_only,
        )
