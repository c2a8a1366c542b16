"""A code problem's tests, read from the layouts real code datasets use.

Two kinds of test (docs/algorithms.md "Code reward"):

* `StdioTest`: the program reads `stdin` and must print `stdout`, compared line by line with
  each line's surrounding whitespace and trailing blank lines ignored;
* `CallTest`: the program defines `fn_name`; called with `args`, it must return `expected`
  (compared with ==, floats with a relative tolerance of 1e-6, tuples as lists).

Layouts (`generator.reward.code.layout`; `auto` tells them apart by shape). The ground truth is
the row's `data.answer_field` — a JSON string, or the JSON of the field's value; with several
answer fields, a JSON object of them by path:

    taco           TACO / APPS `input_output`: {"inputs": [...], "outputs": [...],
                   "fn_name"?: str}. Without `fn_name` each input is a stdin text and each
                   output the stdout expected; with it each input is the list of arguments and
                   each output the return value (APPS wraps it in a one-element list, which
                   is unwrapped when the function's result is not itself that list).
    livecodebench  LiveCodeBench: {"public_test_cases": ..., "private_test_cases": ...,
                   "metadata"?: {"func_name": ...}}, each a JSON list of {"input", "output",
                   "testtype": "stdin" | "functional"}; a functional input is one JSON value
                   per line, the arguments, and its output the JSON of the return value.
                   (`data.answer_field: [public_test_cases, private_test_cases, metadata]`.)
    verl           verl's `reward_model.ground_truth`: a JSON string holding either of the
                   above (a TACO object, or a list of LiveCodeBench-style cases).

A test spec that cannot be read is a data error (`TestSpecError`), never a zero for the policy.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "LAYOUTS",
    "CallTest",
    "CodeTests",
    "Layout",
    "StdioTest",
    "TestSpecError",
    "read_tests",
]

Layout = Literal["auto", "taco", "livecodebench", "verl"]
LAYOUTS: tuple[Layout, ...] = ("auto", "taco", "livecodebench", "verl")


class TestSpecError(ValueError):
    """A problem's tests cannot be read; the message names the field and what is wrong."""

    __test__ = False  # not a pytest class


@dataclass(frozen=True)
class StdioTest:
    """Run the program with `stdin`; it passes when it prints `stdout`."""

    stdin: str
    stdout: str

    def as_input(self) -> dict[str, Any]:
        """What the harness in the box gets: the input only."""
        return {"kind": "stdio", "stdin": self.stdin}


@dataclass(frozen=True)
class CallTest:
    """Call the program's `fn_name(*args)`; it passes when it returns `expected` (or, with
    `unwrap`, the single element of a one-element `expected`)."""

    fn_name: str
    args: tuple[Any, ...]
    expected: Any
    unwrap: bool = False

    def as_input(self) -> dict[str, Any]:
        """What the harness in the box gets: the call, not its answer."""
        return {"kind": "call", "fn_name": self.fn_name, "args": list(self.args)}


Test = StdioTest | CallTest


@dataclass(frozen=True)
class CodeTests:
    """A problem's tests: `public` ones a model may be shown (an agent's feedback) and
    `hidden` ones it is scored on as well. Datasets that do not split them are all public."""

    public: tuple[Test, ...]
    hidden: tuple[Test, ...] = ()

    @property
    def all(self) -> tuple[Test, ...]:
        return self.public + self.hidden


def read_tests(ground_truth: str, layout: Layout = "auto") -> CodeTests:
    """The tests a ground truth holds, in `layout` (module docstring).

    Raises:
        TestSpecError: not JSON, not the layout's shape, or no test at all.
    """
    spec = _json(ground_truth, "the ground truth")
    if layout == "verl":
        spec = _json(spec, "reward_model.ground_truth") if isinstance(spec, str) else spec
        layout = "auto"
    if layout == "auto":
        layout = _detect(spec)
    tests = _taco(spec) if layout == "taco" else _livecodebench(spec)
    if not tests.all:
        raise TestSpecError("the problem has no test: give at least one input and its output")
    return tests


def _detect(spec: Any) -> Layout:
    if isinstance(spec, Mapping) and "inputs" in spec:
        return "taco"
    if isinstance(spec, Mapping) and ("public_test_cases" in spec or "private_test_cases" in spec):
        return "livecodebench"
    if isinstance(spec, list):
        return "livecodebench"
    keys = sorted(spec) if isinstance(spec, Mapping) else type(spec).__name__
    raise TestSpecError(
        f"cannot tell the tests' layout from {keys}: expected TACO's {{inputs, outputs, "
        "fn_name}}, LiveCodeBench's {public_test_cases, private_test_cases} or a list of "
        "{input, output} cases; set generator.reward.code.layout"
    )


def _json(value: Any, where: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as error:
        raise TestSpecError(f"{where} is not JSON ({error.msg} at char {error.pos})") from None


def _taco(spec: Any) -> CodeTests:
    spec = _json(spec, "input_output")
    if not isinstance(spec, Mapping):
        raise TestSpecError(f"input_output must be an object, got {type(spec).__name__}")
    inputs, outputs = spec.get("inputs"), spec.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise TestSpecError("input_output needs lists 'inputs' and 'outputs'")
    if len(inputs) != len(outputs):
        raise TestSpecError(
            f"input_output has {len(inputs)} inputs but {len(outputs)} outputs; they pair up"
        )
    fn_name = spec.get("fn_name")
    if fn_name is None:
        return CodeTests(tuple(StdioTest(_text(i, "input"), _text(o, "output"))
                               for i, o in zip(inputs, outputs, strict=True)))  # fmt: skip
    if not isinstance(fn_name, str) or not fn_name.isidentifier():
        raise TestSpecError(f"input_output.fn_name {fn_name!r} is not a function name")
    tests = []
    for i, (args, expected) in enumerate(zip(inputs, outputs, strict=True)):
        if not isinstance(args, list):
            raise TestSpecError(f"input_output.inputs[{i}] must be the list of arguments")
        unwrap = isinstance(expected, list) and len(expected) == 1
        tests.append(CallTest(fn_name, tuple(args), expected, unwrap))
    return CodeTests(tuple(tests))


def _livecodebench(spec: Any) -> CodeTests:
    if isinstance(spec, list):
        return CodeTests(_cases(spec, "tests", None))
    metadata = _json(spec.get("metadata") or {}, "metadata")
    fn_name = metadata.get("func_name") if isinstance(metadata, Mapping) else None
    public = _cases(_json(spec.get("public_test_cases") or [], "public_test_cases"),
                    "public_test_cases", fn_name)  # fmt: skip
    hidden = _cases(_json(spec.get("private_test_cases") or [], "private_test_cases"),
                    "private_test_cases", fn_name)  # fmt: skip
    return CodeTests(public, hidden)


def _cases(cases: Any, field: str, fn_name: str | None) -> tuple[Test, ...]:
    if not isinstance(cases, list):
        raise TestSpecError(f"{field} must be a list of test cases")
    tests: list[Test] = []
    for i, case in enumerate(cases):
        if not isinstance(case, Mapping) or "input" not in case or "output" not in case:
            raise TestSpecError(f"{field}[{i}] must be an object with 'input' and 'output'")
        kind = case.get("testtype", "stdin")
        if kind == "stdin":
            tests.append(StdioTest(_text(case["input"], "input"), _text(case["output"], "output")))
        elif kind == "functional":
            name = case.get("fn_name", fn_name)
            if not isinstance(name, str) or not name.isidentifier():
                raise TestSpecError(
                    f"{field}[{i}] is a functional test but the problem names no function "
                    "(metadata.func_name)"
                )
            args = tuple(_json(line, f"{field}[{i}].input") for line in _lines(case["input"]))
            tests.append(CallTest(name, args, _json(case["output"], f"{field}[{i}].output")))
        else:
            raise TestSpecError(f"{field}[{i}].testtype {kind!r} is not 'stdin' or 'functional'")
    return tuple(tests)


def _lines(text: Any) -> Sequence[str]:
    return [line for line in _text(text, "input").splitlines() if line.strip()]


def _text(value: Any, what: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "\n".join(value)  # some TACO rows give a stdin as a list of lines
    raise TestSpecError(f"a test's {what} must be text, got {type(value).__name__}")
