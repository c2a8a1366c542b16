"""The `code_feedback` environment: a code agent that learns from running its program. The
model writes a program; the environment runs it on the problem's public tests in the box and,
while some fail, answers with the failures and asks for a corrected program. The episode ends
when the public tests pass or at `generator.env.max_turns`; the final program is scored by the
`code` reward on every test, public and hidden (`generator.reward.fn: code`, whose settings —
limits, layout, `all` or `fraction` — it shares).

Each turn's reward is the share of public tests it passed, recorded per turn
(`rollout/turn<i>_reward_mean`), and the turn of the first full pass gives
`rollout/turns_to_full_mean`. Feedback names at most `MAX_FAILURES_SHOWN` failed tests, each
with its input, what was expected and what happened, cut to the step's
`observation_max_chars`. A program the public tests cannot judge (none in the answer) is told
so. State: {"turns": n, "passed": [share per turn]}.
"""

from __future__ import annotations

import json
from typing import Any

from streamrl.envs.base import EnvContext, Environment, Reset, Step, Task
from streamrl.envs.limits import truncate
from streamrl.rewards.code.cases import CallTest, StdioTest, read_tests
from streamrl.rewards.code.reward import CodeReward
from streamrl.rewards.code.verdicts import TestReport

__all__ = ["MAX_FAILURES_SHOWN", "NO_PROGRAM", "CodeFeedbackEnv"]

MAX_FAILURES_SHOWN = 3


class CodeFeedbackEnv(Environment):
    """Program, public tests' failures, corrected program (module docstring)."""

    def __init__(self, context: EnvContext) -> None:
        if not isinstance(context.reward, CodeReward):
            raise ValueError(
                "the code_feedback environment runs programs with the code reward's settings: "
                f"set generator.reward.fn: code (it is {context.reward_fn!r})"
            )
        super().__init__(context)
        self.code: CodeReward = context.reward

    def reset(self, task: Task) -> Reset:
        read_tests(task.ground_truth, self.code.settings.layout)  # a data error fails here
        return Reset(list(task.messages), {"turns": 0, "passed": []})

    def step(self, task: Task, state: Any, text: str) -> Step:
        turns = state["turns"] + 1
        tests = read_tests(task.ground_truth, self.code.settings.layout).public
        report = self.code.report(text, task.ground_truth, public_only=True)
        share = 0.0 if report is None or report.total == 0 else report.passed / report.total
        state = {"turns": turns, "passed": [*state["passed"], share]}
        if share == 1.0:  # `generator.env.max_turns` ends the episode otherwise
            return Step(state=state, done=True, reward=share)
        message = _feedback(tests, report) if report is not None else NO_PROGRAM
        limit = self.context.observation_max_chars
        return Step([{"role": "user", "content": truncate(message, limit)}], state, reward=share)


NO_PROGRAM = (
    "I found no program in your answer. Write the complete program in one ```python code block."
)


def _feedback(tests: tuple[StdioTest | CallTest, ...], report: TestReport) -> str:
    """The public tests' verdict: how many passed, and the first failures."""
    lines = [f"Your program passed {report.passed} of {report.total} tests."]
    if report.compile_error:
        lines.append(f"It did not compile:\n{report.compile_error}")
    failures = [
        _failure(test, status, detail)
        for test, status, detail in zip(tests, report.statuses, report.details, strict=True)
        if status not in ("passed", "not run")
    ]
    lines += failures[:MAX_FAILURES_SHOWN]
    if len(failures) > MAX_FAILURES_SHOWN:
        lines.append(f"({len(failures) - MAX_FAILURES_SHOWN} more failed.)")
    lines.append(
        "Fix the program and send the complete corrected version in one ```python code block."
    )
    return "\n\n".join(lines)


def _failure(test: StdioTest | CallTest, status: str, detail: str) -> str:
    if isinstance(test, CallTest):
        call = f"{test.fn_name}({', '.join(json.dumps(a) for a in test.args)})"
        head = f"{call} should return {json.dumps(test.expected)}"
    else:
        head = f"For the input {_quoted(test.stdin)} it should print {_quoted(test.stdout)}"
    return f"- {head}: {status}{f' ({detail})' if detail else ''}"


def _quoted(text: str, limit: int = 200) -> str:
    text = text if len(text) <= limit else text[:limit] + "..."
    return json.dumps(text)
