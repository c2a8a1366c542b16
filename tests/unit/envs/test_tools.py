"""Tests for tools and tool-call formats (`streamrl.envs.tools`, `formats`, `tool_env`) and the
calculator: schemas from type hints, argument checks, parsing real chat-template output of the
bundled tokenizers and of Qwen2.5's tool template, malformed calls answered with errors."""

from __future__ import annotations

import operator
import re
from pathlib import Path
from typing import Literal

import pytest
from transformers import AutoTokenizer

from streamrl.envs import TOOL_FORMATS, EnvContext, Task, ToolCall, resolve_tool_format, tool
from streamrl.envs.calculator import CalculatorEnv, calculate, evaluate_arithmetic
from streamrl.envs.tools import ToolDefinitionError, run_tool_call, truncate
from streamrl.models import resolve_model_path
from streamrl.rewards import math_reward

HERMES, TAGGED = TOOL_FORMATS["hermes"], TOOL_FORMATS["tagged"]

# Qwen2.5-Instruct's chat template (the tool-calling one its tokenizer_config.json ships).
QWEN25_TEMPLATE = (Path(__file__).parents[2] / "qwen25_chat_template.jinja").read_text()


def lookup(word: str, limit: int, scale: float = 1.0, exact: bool = False) -> str:
    """Look a word up.

    Longer explanation that is not part of the description.

    Args:
        word: The word to look up,
            lower case.
        limit (int): At most this many entries.
        scale: A factor.
    """
    return f"{word}:{limit}:{scale}:{exact}"


def choose(mode: Literal["a", "b"], tags: list[str], note: str | None = None) -> dict:
    """Pick a mode."""
    return {"mode": mode, "tags": tags, "note": note}


def fails(x: int) -> str:
    """Always raises."""
    raise KeyError(f"no entry {x}")


TOOLS = {t.name: t for t in (tool(lookup), tool(choose), tool(fails), CalculatorEnv.tools[0])}


def _assistant_turns(rendered: str) -> list[str]:
    """The assistant turns of a ChatML rendering, as the model sampled them."""
    parts = rendered.split("<|im_start|>assistant\n")[1:]
    return [part.split("<|im_end|>")[0] for part in parts]


# -- schemas and argument checks -------------------------------------------------------------


def test_schema_is_derived_from_type_hints_and_docstring() -> None:
    t = TOOLS["lookup"]
    assert t.description == "Look a word up."
    assert t.parameters == {
        "type": "object",
        "properties": {
            "word": {"type": "string", "description": "The word to look up, lower case."},
            "limit": {"type": "integer", "description": "At most this many entries."},
            "scale": {"type": "number", "description": "A factor.", "default": 1.0},
            "exact": {"type": "boolean", "default": False},
        },
        "required": ["word", "limit"],
    }
    assert TOOLS["choose"].parameters["properties"] == {
        "mode": {"enum": ["a", "b"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "note": {"type": "string", "default": None},
    }
    usage = "lookup(word: string, limit: integer, scale: number = 1.0, exact: boolean = False)"
    assert t.usage() == usage
    choose_usage = 'choose(mode: "a" | "b", tags: array, note: string = None)'
    assert TOOLS["choose"].usage() == choose_usage
    assert t.schema == {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up.",
            "parameters": t.parameters,
        },
    }
    given = tool(lookup, name="find", parameters={"type": "object", "properties": {}})
    assert (given.name, given.parameters["properties"]) == ("find", {})


def unit_convert(value: float, from_unit: str, to_unit: Literal["m", "ft"], digits: int = 3) -> str:
    """Convert a length between units.

    Args:
        value: The number to convert.
    """
    return f"{value}{from_unit}->{to_unit}:{digits}"


def test_the_example_call_in_the_prompt_has_every_argument_of_the_signature() -> None:
    # A call with only the first two arguments would itself fail: every required argument at a
    # placeholder of its type (an enum at its first value), each optional one at its default.
    prompt = TAGGED.system_prompt([tool(unit_convert)])
    example = 'unit_convert(value=1.5, from_unit="...", to_unit="m", digits=3)'
    assert f"<tool>{example}</tool>" in prompt
    (call,) = TAGGED.parse(f"<tool>{example}</tool>")
    assert run_tool_call({"unit_convert": tool(unit_convert)}, call, 100).ok


def no_docstring(value: float) -> str:
    return str(value)


def no_hint(value, unit: str) -> str:  # type: ignore[no-untyped-def]
    """Convert a value."""
    return str(value)


def test_a_tool_the_model_would_be_shown_blind_is_refused_naming_what_is_missing() -> None:
    with pytest.raises(ToolDefinitionError, match=r"'no_docstring' has no docstring.*description="):
        tool(no_docstring)
    with pytest.raises(ToolDefinitionError, match="'no_hint': argument 'value' has no type hint"):
        tool(no_hint)
    # Given what is missing, the same functions are tools.
    assert tool(no_docstring, description="Show a value.").description == "Show a value."
    schema = {"type": "object", "properties": {"value": {"type": "number"}}, "required": []}
    assert tool(no_hint, parameters=schema).parameters == schema


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (ToolCall("lookup", {"word": "cat", "limit": 2}), "cat:2:1.0:False"),
        (ToolCall("lookup", {"limit": 3}, positional=("dog",)), "dog:3:1.0:False"),
        (
            ToolCall("lookup", {"word": "a", "limit": 1, "scale": 2}),
            "a:1:2:False",
        ),  # int is a number
        (
            ToolCall("choose", {"mode": "b", "tags": ["x"]}),
            '{"mode": "b", "tags": ["x"], "note": null}',
        ),
    ],
)
def test_a_well_formed_call_runs(call: ToolCall, expected: str) -> None:
    result = run_tool_call(TOOLS, call, max_chars=1000)
    assert (result.ok, result.content) == (True, expected)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (ToolCall("lookup", {"word": "cat"}), "missing argument 'limit'"),
        (
            ToolCall("lookup", {"word": "cat", "limit": 1, "colour": "red"}),
            "unknown argument 'colour'",
        ),
        (ToolCall("lookup", {"word": 3, "limit": 1}), "argument 'word' must be string, got int"),
        (
            ToolCall("lookup", {"word": "a", "limit": True}),
            "argument 'limit' must be integer, got bool",
        ),
        (ToolCall("lookup", {"word": "a", "limit": 1.5}), "must be integer, got float"),
        (ToolCall("lookup", {"word": "a"}, positional=("b",)), "argument 'word' given twice"),
        (ToolCall("choose", {"mode": "c", "tags": []}), "must be one of ['a', 'b']"),
        (ToolCall("choose", {"mode": "a", "tags": [1]}), "argument 'tags' item must be string"),
        (ToolCall("fails", {"x": 1}), "KeyError: 'no entry 1'"),
        (ToolCall("search", {"q": "x"}), "unknown tool 'search'; the tools are: calculate, choose"),
        (ToolCall("", error="not valid JSON"), "could not be read: not valid JSON"),
    ],
)
def test_a_malformed_call_is_answered_with_an_error(call: ToolCall, message: str) -> None:
    result = run_tool_call(TOOLS, call, max_chars=1000)
    assert not result.ok
    assert result.content.startswith("Error: ")
    assert message in result.content


def test_long_results_are_cut_to_the_character_budget() -> None:
    result = run_tool_call(TOOLS, ToolCall("lookup", {"word": "ab" * 500, "limit": 1}), 100)
    assert len(result.content) <= 100
    assert result.content.startswith("abab")
    assert "more characters cut; limit 100" in result.content
    assert truncate("short", 100) == "short"


# -- the Hermes format -----------------------------------------------------------------------


def test_hermes_reads_several_calls_and_tolerates_common_slips() -> None:
    text = (
        "Let me compute.\n<tool_call>\n"
        '{"name": "calculate", "arguments": {"expression": "2 + 3"}}\n</tool_call>\n'
        '<tool_call>{"name": "lookup", "arguments": "{\\"word\\": \\"x\\", \\"limit\\": 1}"}'
        "</tool_call>\n"
        '<tool_call>\n{"name": "calculate", "arguments": {"expression": "7"}}'  # left open
    )
    assert HERMES.parse(text) == [
        ToolCall("calculate", {"expression": "2 + 3"}),
        ToolCall("lookup", {"word": "x", "limit": 1}),
        ToolCall("calculate", {"expression": "7"}),
    ]
    assert HERMES.parse("The answer is \\boxed{5}.") == []


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ('{"name": "calculate", "arguments": {"expression": "2"}', "not valid JSON"),
        ('["calculate"]', "expected a JSON object"),
        ('{"arguments": {}}', "expected a JSON object"),
        ('{"name": "calculate", "arguments": [1]}', '"arguments" must be a JSON object'),
    ],
)
def test_hermes_malformed_calls_become_error_observations(body: str, problem: str) -> None:
    (call,) = HERMES.parse(f"<tool_call>{body}</tool_call>")
    assert call.error is not None
    assert problem in call.error
    (message,) = HERMES.observe([run_tool_call(TOOLS, call, 1000)])
    assert message["role"] == "tool"
    assert message["content"].startswith("Error: the tool call could not be read")


def test_hermes_round_trips_through_the_qwen_template() -> None:
    """A call rendered as Qwen2.5's template writes an assistant's tool_calls (the form the model
    learned) is parsed back to the same call, from text and from its token ids."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny-qwen2"))
    assert resolve_tool_format("auto", QWEN25_TEMPLATE) == "hermes"
    tools = [TOOLS["calculate"], TOOLS["lookup"]]
    calls = [("calculate", {"expression": "12 * (3 + 4)"}), ("lookup", {"word": "é", "limit": 2})]
    messages = [
        {"role": "user", "content": "What is 12 * (3 + 4)?"},
        {
            "role": "assistant",
            "content": "I will compute it.",
            "tool_calls": [
                {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls
            ],
        },
        *HERMES.observe([run_tool_call(TOOLS, ToolCall(n, a), 1000) for n, a in calls]),
    ]
    rendered = tokenizer.apply_chat_template(
        messages, tools=HERMES.template_tools(tools), chat_template=QWEN25_TEMPLATE,
        tokenize=False, add_generation_prompt=True,
    )  # fmt: skip
    assert '"name": "calculate", "description": "Evaluate an arithmetic' in rendered
    assert "<tool_response>\n84\n</tool_response>" in rendered
    assert "<tool_response>\n" + "é:2:1.0:False" in rendered
    (turn, _) = _assistant_turns(rendered)
    for name, arguments in calls:
        assert HERMES.format_call(name, arguments) in turn  # what the model is taught to write
    expected = [ToolCall(n, a) for n, a in calls]
    assert HERMES.parse(turn) == expected
    sampled = tokenizer.decode(tokenizer(turn, add_special_tokens=False)["input_ids"])
    assert HERMES.parse(sampled) == expected


# -- the tagged format -----------------------------------------------------------------------


def test_tagged_reads_python_calls_and_json() -> None:
    text = (
        'First <tool>calculate(expression="2 + 3")</tool> then\n'
        "<tool> lookup('cat', limit=2, scale=0.5) </tool>"
        '<tool>{"name": "choose", "arguments": {"mode": "a", "tags": []}}</tool>'
        '<tool>calculate(expression="""1 +\n2""")'  # left open, multi-line string
    )
    assert TAGGED.parse(text) == [
        ToolCall("calculate", {"expression": "2 + 3"}),
        ToolCall("lookup", {"limit": 2, "scale": 0.5}, positional=("cat",)),
        ToolCall("choose", {"mode": "a", "tags": []}),
        ToolCall("calculate", {"expression": "1 +\n2"}),
    ]


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ("calculate(expression=", "not a call"),
        ("calculate", "expected a call"),
        ("os.system('ls')", "expected a call"),
        ("calculate(expression=__import__('os').getcwd())", "arguments must be literals"),
        ("calculate(**{'expression': '1'})", "**arguments are not allowed"),
        ('{"name": calculate}', "not valid JSON"),
    ],
)
def test_tagged_malformed_calls_are_refused_without_evaluating_them(
    body: str, problem: str
) -> None:
    (call,) = TAGGED.parse(f"<tool>{body}</tool>")
    assert call.error is not None
    assert problem in call.error
    (message,) = TAGGED.observe([run_tool_call(TOOLS, call, 1000)])
    assert message["role"] == "user"
    assert "Error: the tool call could not be read" in message["content"]


@pytest.mark.parametrize("model", ["tiny-qwen2", "smollm2-135m-instruct"])
def test_tagged_calls_round_trip_through_a_template_without_tools(model: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model))
    assert resolve_tool_format("auto", tokenizer.chat_template) == "tagged"
    tools = [TOOLS["calculate"]]
    prompt = TAGGED.prompt([{"role": "user", "content": "What is 6 × 7?"}], tools)
    call = TAGGED.format_call("calculate", {"expression": "6 * 7"})
    assert call == '<tool>calculate(expression="6 * 7")</tool>'
    result = run_tool_call(TOOLS, TAGGED.parse(call)[0], 1000)
    messages = [
        *prompt,
        {"role": "assistant", "content": f"Let me check. {call}"},
        *TAGGED.observe([result]),
        {"role": "assistant", "content": "\\boxed{42}"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert '<tool>calculate(expression="12 * (3 + 4)")</tool>' in rendered  # the example
    assert "- calculate(expression: string): Evaluate an arithmetic" in rendered
    assert '<tool_result name="calculate">\n42\n</tool_result>' in rendered
    first, last = _assistant_turns(rendered)
    sampled = tokenizer.decode(tokenizer(first, add_special_tokens=False)["input_ids"])
    assert TAGGED.parse(sampled) == [ToolCall("calculate", {"expression": "6 * 7"})]
    assert TAGGED.parse(last) == []


def test_tagged_prompt_extends_a_system_message_the_row_brings() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = TAGGED.prompt(messages, [TOOLS["calculate"]])
    assert len(prompt) == 2
    assert prompt[1] == messages[1]
    assert prompt[0]["content"].startswith("Be brief.\n\nYou can use tools.")
    assert TAGGED.prompt(messages, []) == messages
    assert HERMES.prompt(messages, [TOOLS["calculate"]]) == messages
    assert TAGGED.template_tools([TOOLS["calculate"]]) is None


# -- the calculator --------------------------------------------------------------------------

SAFE = [
    ("2 + 3", 5),
    ("12 * (3 + 4)", 84),
    ("7 - 10", -3),
    ("7 / 2", 3.5),
    ("7 // 2", 3),
    ("-7 % 3", 2),
    ("2 ** 10", 1024),
    ("2 ** -1", 0.5),
    ("-(3 - 5) * +2", 4),
    ("1.5 * 4", 6.0),
    ("3 × 4 ÷ 2", 6.0),
]


@pytest.mark.parametrize(("expression", "expected"), SAFE)
def test_calculator_evaluates_arithmetic(expression: str, expected: float) -> None:
    assert evaluate_arithmetic(expression) == expected


def test_calculator_answers_as_text() -> None:
    assert calculate("6 / 2") == "3"
    assert calculate("7 / 2") == "3.5"
    assert calculate(" 9*9 ") == "81"
    ops = {"+": operator.add, "*": operator.mul}
    for a, op, b in [(9, "*", 8), (2, "+", 9), (5, "*", 5)]:
        assert calculate(f"{a} {op} {b}") == str(ops[op](a, b))


@pytest.mark.parametrize(
    ("expression", "problem"),
    [
        ("__import__('os').system('echo hi')", "Call is not allowed"),
        ("().__class__", "Attribute is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("'a' * 3", "'a' is not a number"),
        ("True + 1", "True is not a number"),
        ("lambda: 1", "Lambda is not allowed"),
        ("1 < 2", "Compare is not allowed"),
        ("[1, 2]", "List is not allowed"),
        ("2 ^ 3", "write **"),
        ("9 ** 9 ** 9", "exponents are limited"),
        ("10 ** 1000 * 10 ** 1000", "larger than 4096 bits"),
        ("99 ** 999", "larger than 4096 bits"),
        ("1e308 * 10", "too large"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "is not an arithmetic expression"),
        ("1" * 501, "longer than 500 characters"),
    ],
)
def test_calculator_refuses_anything_but_bounded_arithmetic(expression: str, problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        evaluate_arithmetic(expression)
    result = run_tool_call(TOOLS, ToolCall("calculate", {"expression": expression}), 1000)
    assert not result.ok
    assert problem in result.content


# -- a tool environment's turns, in process --------------------------------------------------


def test_calculator_env_runs_calls_until_a_turn_without_one() -> None:
    env = CalculatorEnv(EnvContext(math_reward, "math", TAGGED, observation_max_chars=1000))
    task = Task([{"role": "user", "content": "What is 6 × 7?"}], "42")
    reset = env.reset(task)
    assert reset.messages[0]["role"] == "system"
    assert reset.messages[1:] == task.messages
    assert env.template_tools() is None
    step = env.step(
        task, reset.state, '<tool>calculate(expression="6*7")</tool><tool>sqrt(2)</tool>'
    )
    assert not step.done
    assert (step.tool_calls, step.tool_errors) == (2, 1)
    assert "42" in step.messages[0]["content"]
    assert "unknown tool 'sqrt'" in step.messages[0]["content"]
    many = "".join('<tool>calculate(expression="1")</tool>' for _ in range(6))
    flood = env.step(task, step.state, many)
    (flooded,) = flood.messages
    assert flooded["content"].count("<tool_result") == 5  # four run, one for the rest
    assert (
        "Error: 2 more tool calls in this turn were not run: at most 4 per turn"
        in (flooded["content"])
    )
    assert (flood.tool_calls, flood.tool_errors) == (6, 2)  # this turn's
    final = env.step(task, flood.state, "So the answer is \\boxed{42}.")
    assert final.done
    assert final.messages == []
    assert env.score(task, final.state, "So the answer is \\boxed{42}.") == 1.0
    hermes = CalculatorEnv(EnvContext(math_reward, "math", HERMES))
    assert hermes.reset(task).messages == task.messages
    assert hermes.template_tools() == [hermes.toolbox["calculate"].schema]
