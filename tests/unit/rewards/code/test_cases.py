"""Reading a code problem's tests from the layouts real datasets use
(`streamrl.rewards.code.cases`), on hand-made rows of each, and the data errors a malformed
spec raises."""

from __future__ import annotations

import json

import pytest

from streamrl.data.rows import DatasetError
from streamrl.rewards.code.cases import CallTest, StdioTest, TestSpecError, read_tests
from streamrl.rewards.config import RewardConfig

TACO_STDIO = {"inputs": ["1 2\n", ["3 4", ""]], "outputs": ["3\n", "7"]}
TACO_CALL = {"inputs": [[1, 2], [[1, 2]]], "outputs": [[3], 3], "fn_name": "add"}
LCB_ROW = {
    "public_test_cases": json.dumps([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]),
    "private_test_cases": json.dumps(
        [{"input": "[1, 2]\n5", "output": "[6, 7]", "testtype": "functional"}]
    ),
    "metadata": json.dumps({"func_name": "shift"}),
}


def test_taco_stdin_tests_read_as_text_and_lines() -> None:
    tests = read_tests(json.dumps(TACO_STDIO), "taco")
    assert tests.public == (StdioTest("1 2\n", "3\n"), StdioTest("3 4\n", "7"))
    assert tests.hidden == ()


def test_taco_call_tests_unwrap_only_one_element_lists() -> None:
    tests = read_tests(json.dumps(TACO_CALL), "taco")
    assert tests.public == (
        CallTest("add", (1, 2), [3], unwrap=True),
        CallTest("add", ([1, 2],), 3, unwrap=False),
    )


def test_livecodebench_splits_public_and_private_and_reads_functional_arguments() -> None:
    tests = read_tests(json.dumps(LCB_ROW), "livecodebench")
    assert tests.public == (StdioTest("1 2\n", "3\n"),)
    assert tests.hidden == (CallTest("shift", ([1, 2], 5), [6, 7]),)
    assert tests.all == tests.public + tests.hidden


def test_verl_ground_truth_holds_either_layout_as_a_json_string() -> None:
    assert read_tests(json.dumps(json.dumps(TACO_CALL)), "verl") == read_tests(
        json.dumps(TACO_CALL), "taco"
    )
    cases = [{"input": "5\n", "output": "25\n"}]
    assert read_tests(json.dumps(cases), "verl").public == (StdioTest("5\n", "25\n"),)


@pytest.mark.parametrize("spec", [TACO_STDIO, TACO_CALL, LCB_ROW, [{"input": "", "output": ""}]])
def test_auto_tells_the_layouts_apart(spec: object) -> None:
    layout = "livecodebench" if isinstance(spec, list) or "metadata" in spec else "taco"
    assert read_tests(json.dumps(spec)) == read_tests(json.dumps(spec), layout)


@pytest.mark.parametrize(
    ("ground_truth", "message"),
    [
        ("{not json", "not JSON"),
        (json.dumps({"inputs": ["1"], "outputs": []}), "1 inputs but 0 outputs"),
        (json.dumps({"inputs": "1", "outputs": "2"}), "needs lists 'inputs' and 'outputs'"),
        (json.dumps({"inputs": [1], "outputs": [2], "fn_name": "not a name"}), "not a function"),
        (json.dumps({"inputs": [1], "outputs": [2], "fn_name": "f"}), r"inputs\[0\] must be"),
        (json.dumps({"inputs": [], "outputs": []}), "no test"),
        (json.dumps({"tests": 1}), "cannot tell the tests' layout"),
        (json.dumps([{"input": "1"}]), r"tests\[0\] must be an object with 'input' and 'output'"),
        (
            json.dumps({"public_test_cases": [{"input": "1", "output": "1", "testtype": "x"}]}),
            "testtype 'x'",
        ),
        (
            json.dumps(
                {"private_test_cases": [{"input": "1", "output": "1", "testtype": "functional"}]}
            ),
            "names no function",
        ),
        (json.dumps({"inputs": [3], "outputs": ["3"]}), "input must be text"),
    ],
)
def test_a_malformed_spec_is_a_data_error_naming_the_field(ground_truth: str, message: str) -> None:
    with pytest.raises(TestSpecError, match=message):
        read_tests(ground_truth)


def test_a_generator_refuses_a_dataset_whose_tests_cannot_be_read_naming_row_and_field() -> None:
    good = json.dumps(TACO_STDIO)
    bad = json.dumps({"inputs": ["1"], "outputs": []})
    config = RewardConfig(fn="code")
    config.check_ground_truths([("data:0", good)], "input_output")
    with pytest.raises(DatasetError, match=r"row data:1, field 'input_output' \(auto layout\)"):
        config.check_ground_truths([("data:0", good), ("data:1", bad)], "input_output")
    RewardConfig(fn="math").check_ground_truths([("data:1", bad)], "input_output")  # its own
