"""Malformed SFT rows, written as an attacker would (`streamrl.envs.conversations`,
`streamrl.envs.schema_check`, `streamrl.learner.supervised`): `tool_calls` a number, arguments
nested 100,000 deep (as an object and as JSON text), a tool's `properties` a list or its
`required` naming an argument it does not declare, and their kin are each refused as a
`ConversationError` naming the message and the field — never a `TypeError`, `RecursionError`
or `AttributeError` — and an SFT dataset holding one is refused naming its row."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from streamrl.config.loading import load_config
from streamrl.data.rows import DatasetError
from streamrl.envs.conversations import ConversationError, ConversationRenderer, tools_from_schemas
from streamrl.envs.schema_check import SchemaError, check_nesting, check_tool_schemas, loads_json
from streamrl.learner.supervised import SupervisedSource
from streamrl.models import resolve_model_path

DEEP = 100_000
USER = {"role": "user", "content": "What is 3 + 4?"}
ANSWER = {"role": "assistant", "content": "7"}


def _deep_object(depth: int) -> dict:
    value: dict = {"x": 1}
    for _ in range(depth):
        value = {"a": value}
    return value


def _deep_text(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


def _calling(arguments) -> list[dict]:
    call = {"type": "function", "function": {"name": "calculate", "arguments": arguments}}
    return [USER, {"role": "assistant", "content": "", "tool_calls": [call]}]


def _tool(parameters) -> dict:
    return {"type": "function", "function": {"name": "calc", "description": "Adds.",
                                             "parameters": parameters}}  # fmt: skip


@pytest.fixture(scope="module")
def renderers():
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny-qwen2"))
    return [ConversationRenderer(tokenizer, fmt) for fmt in ("hermes", "tagged")]


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([USER, {"role": "assistant", "content": "", "tool_calls": 5}],
         r"^message 1 \(assistant\): tool_calls must be a list of calls, got int"),
        ([USER, {"role": "assistant", "content": "", "tool_calls": "call it"}],
         r"^message 1 \(assistant\): tool_calls must be a list of calls, got str"),
        ([USER, {"role": "assistant", "content": "", "tool_calls": {"name": "f"}}],
         r"^message 1 \(assistant\): tool_calls must be a list"),
        ([USER, {"role": "assistant", "content": "", "tool_calls": [5]}],
         r"^message 1 \(assistant\) tool_calls\[0\] needs a function name, got 5"),
        ([USER, {"role": "assistant", "content": "", "tool_calls": [{"function": 3}]}],
         r"^message 1 \(assistant\) tool_calls\[0\] needs a function name"),
        ([USER, {"role": "assistant", "tool_calls": [{"function": {"name": ["f"]}}]}],
         r"^message 1 \(assistant\) tool_calls\[0\] needs a function name"),
        (_calling([1, 2]), r"tool_calls\[0\]\.function\.arguments must be a JSON object .*list"),
        (_calling(7), r"tool_calls\[0\]\.function\.arguments must be a JSON object .*int"),
        (_calling("[1, 2]"), r"tool_calls\[0\]\.function\.arguments must be a JSON object"),
        (_calling("{not json"), r"tool_calls\[0\]\.function\.arguments is not JSON"),
        ([USER, {"role": "user", "content": "", "tool_calls": 5}],
         r"^message 1 \(user\): tool_calls must be a list"),
        ([USER, ANSWER, {"role": "tool", "name": {"n": 1}, "content": "x"}, ANSWER],
         r"^message 2 \(tool\): name must be text, got dict"),
        ([USER, {"role": "assistant", "content": {"text": "7"}}], r"^message 1 \(assistant\): "
         "content must be text, got dict"),
        ([USER, 5], r"^message 1 needs a role"),
        ({"role": "user"}, r"a conversation is a non-empty list of messages"),
    ],
)  # fmt: skip
def test_a_malformed_message_is_refused_naming_it_and_the_field(renderers, messages, match):
    for renderer in renderers:
        with pytest.raises(ConversationError, match=match):
            renderer.render(messages)


@pytest.mark.parametrize("as_text", [False, True], ids=["object", "json-text"])
def test_arguments_nested_100k_deep_are_refused_naming_the_call(renderers, as_text) -> None:
    arguments = _deep_text(DEEP) if as_text else _deep_object(DEEP)
    for renderer in renderers:
        with pytest.raises(ConversationError) as refused:
            renderer.render(_calling(arguments))
        assert str(refused.value) == (
            "message 1 (assistant) tool_calls[0].function.arguments nests more than 64 levels "
            "deep; write it flatter"
        )
    # 64 levels are fine, as object or text
    ok = _deep_text(63) if as_text else _deep_object(63)
    for renderer in renderers:
        assert renderer.render([*_calling(ok), {"role": "tool", "content": "1"}, ANSWER])


@pytest.mark.parametrize(
    ("parameters", "match"),
    [
        ({"type": "object", "properties": ["a", "b"]},
         r"^tools\[0\] \(calc\): parameters\.properties must be an object of schemas by name, "
         "got a list"),
        ({"type": "object", "properties": {"a": "number"}},
         r"^tools\[0\] \(calc\): parameters\.properties\.a must be a schema \(an object\), got "
         "text"),
        ({"type": "object", "properties": {"a": True}},
         r"parameters\.properties\.a must be a schema \(an object\), got a boolean"),
        ({"type": "object", "properties": {"a": {"type": "number"}}, "required": "a"},
         r"^tools\[0\] \(calc\): parameters\.required must be a list of property names"),
        ({"type": "object", "properties": {"a": {"type": "number"}}, "required": [["a"]]},
         r"parameters\.required must be a list of property names"),
        ({"type": "object", "properties": {"a": {"type": "number"}}, "required": ["a", "b"]},
         r'^tools\[0\] \(calc\): parameters\.required names "b", which is not in its '
         "properties: declare it under properties or drop it from required"),
        ({"type": "object", "required": ["a"]}, r'parameters\.required names "a", which is not'),
        ({"type": "object", "properties": {"a": {"enum": "mft"}}},
         r"^tools\[0\] \(calc\): parameters\.properties\.a\.enum must be a list, got text"),
        ({"type": "object", "properties": {"a": {"enum": {"m": 1}}}},
         r"parameters\.properties\.a\.enum must be a list, got an object"),
        ({"type": 7}, r"parameters\.type must be a type name or a list of them, got a number"),
        ({"type": "object", "properties": {"a": {"anyOf": {"type": "string"}}}},
         r"parameters\.properties\.a\.anyOf must be a list of schemas, got an object"),
        ({"type": "object", "properties": {"a": {"anyOf": ["string"]}}},
         r"parameters\.properties\.a\.anyOf\[0\] must be a schema \(an object\), got text"),
        ({"type": "object", "properties": {"a": {"type": "array", "items": 3}}},
         r"parameters\.properties\.a\.items must be a schema \(an object\), got a number"),
        ({"type": "object", "properties": {"a": {"description": ["x"]}}},
         r"parameters\.properties\.a\.description must be text, got a list"),
        (["a", "b"], r"^tools\[0\] \(calc\): parameters must be a JSON schema object, got a list"),
    ],
)  # fmt: skip
def test_a_malformed_tool_schema_is_refused_naming_the_tool_and_field(parameters, match):
    with pytest.raises(ConversationError, match=match):
        tools_from_schemas([_tool(parameters)])
    with pytest.raises(SchemaError, match=match):  # the shared check, as a ValueError
        check_tool_schemas([_tool(parameters)])


@pytest.mark.parametrize(
    ("schemas", "match"),
    [
        ({"type": "function"}, r"^tools must be a list of tool schemas, got an object"),
        ([{"type": "function"}], r"^tools\[0\] is not a function schema with a name"),
        ([{"type": "function", "function": "calc"}], r"^tools\[0\] is not a function schema"),
        ([{"type": "retrieval", "function": {"name": "f"}}],
         r'^tools\[0\]: type must be "function"'),
        ([{"function": {"name": ""}}], r"^tools\[0\] \(\): name is empty"),
        ([{"function": {"name": "f", "description": 3}}],
         r"^tools\[0\] \(f\): description must be"),
        ([_tool({"type": "object"}), _tool({"properties": [1]})],
         r"^tools\[1\] \(calc\): parameters\.properties must be an object"),
    ],
)  # fmt: skip
def test_a_malformed_tools_list_is_refused_naming_the_tool(schemas, match) -> None:
    with pytest.raises(ConversationError, match=match):
        tools_from_schemas(schemas)


def test_a_tool_schema_nested_100k_deep_is_refused_without_recursing() -> None:
    deep = {"type": "object", "properties": {"a": _deep_object(DEEP)}}
    with pytest.raises(ConversationError, match=r"^tools\[0\] \(calc\) nests more than 64 levels"):
        tools_from_schemas([_tool(deep)])


def test_valid_schemas_of_every_shape_the_check_knows_still_render(renderers) -> None:
    parameters = {
        "type": "object",
        "properties": {
            "unit": {"type": ["string", "null"], "description": "The unit."},
            "mode": {"enum": ["m", "ft"]},
            "values": {"type": "array", "items": {"type": "number"}},
            "pair": {"type": "array", "items": [{"type": "number"}, {"type": "string"}]},
            "either": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
            "extra": {"type": "object", "additionalProperties": True},
        },
        "required": ["mode"],
        "$defs": {"unit": {"type": "string"}},
    }
    tools = tools_from_schemas([_tool(parameters)])
    for renderer in renderers:
        assert renderer.render([USER, ANSWER], tools).num_loss_tokens > 0


def test_the_shared_checks_count_depth_without_recursion() -> None:
    check_nesting(_deep_object(63), "x")  # 64 levels: accepted
    with pytest.raises(SchemaError, match=r"^x nests more than 64 levels deep"):
        check_nesting(_deep_object(64), "x")
    with pytest.raises(SchemaError, match=r"^arguments nests more than 64 levels deep"):
        loads_json(_deep_text(DEEP), "arguments")  # json.loads itself would recurse
    assert loads_json(_deep_text(3), "arguments") == {"a": {"a": {"a": 1}}}


def test_an_sft_dataset_with_a_malformed_row_is_refused_naming_the_row(tmp_path) -> None:
    """The issue's rows in a JSONL file: each refused as the dataset's error naming its row and
    the field (a row nested too deep for the JSON reader itself: naming its line)."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny-qwen2"))
    good = json.dumps({"messages": [USER, ANSWER]})
    tools = [_tool({"type": "object", "properties": {"a": {"type": "number"}}})]
    undeclared = [_tool({"type": "object", "properties": {"a": {}}, "required": ["a", "b"]})]
    rows = {
        "tool_calls": (
            json.dumps({"messages": [USER, {"role": "assistant", "tool_calls": 5}]}),
            r"row 1 \(0-based\) of .*rows\.jsonl: message 1 \(assistant\): tool_calls must be a "
            "list of calls",
        ),
        "arguments-text": (
            json.dumps({"messages": _calling(_deep_text(DEEP)), "tools": tools}),
            r"row 1 \(0-based\) of .*rows\.jsonl: message 1 \(assistant\) tool_calls\[0\]\."
            "function.arguments nests more than 64 levels deep",
        ),
        "arguments-object": (
            json.dumps({"messages": _calling("ARGUMENTS")}).replace(
                '"ARGUMENTS"', _deep_text(DEEP)
            ),
            r"rows\.jsonl line 2 nests lists or objects thousands of levels deep",
        ),
        "properties": (
            json.dumps({"messages": [USER, ANSWER], "tools": [_tool({"properties": ["a"]})]}),
            r"row 1 \(0-based\) of .*rows\.jsonl: tools\[0\] \(calc\): parameters\.properties "
            "must be an object of schemas by name, got a list",
        ),
        "required": (
            json.dumps({"messages": [USER, ANSWER], "tools": undeclared}),
            r"row 1 \(0-based\) of .*rows\.jsonl: tools\[0\] \(calc\): parameters\.required "
            'names "b", which is not in its properties',
        ),
    }
    for name, (row, match) in rows.items():
        path = tmp_path / name / "rows.jsonl"
        path.parent.mkdir()
        path.write_text(f"{good}\n{row}\n")
        config = load_config(
            ["grpo", "tiny-cpu"],
            overrides=["sft={tools: row}", f"data.path={path}", "data.val_path=null"],
        )
        with pytest.raises(DatasetError, match=match):
            SupervisedSource(config, tokenizer=tokenizer)
