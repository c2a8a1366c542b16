"""How a model writes tool calls and reads their results: the Hermes format of tool-aware
chat templates, and a tagged format described in the system prompt for templates without tools.

hermes (Qwen2.5, Qwen3, Hermes): the tools go to the chat template as `tools=` (it describes
them in the system message); the model writes each call as

    <tool_call>
    {"name": "calculate", "arguments": {"expression": "2 + 3"}}
    </tool_call>

— several per turn allowed — and each result comes back as a `{"role": "tool", "name": ...,
"content": ...}` message (Qwen's template wraps it in <tool_response>).

tagged (SmolLM2 and other templates that know no tools): the system prompt describes the tools
and the format (`TaggedFormat.system_prompt`); the model writes Python call syntax with literal
arguments, or the same JSON as hermes, inside <tool> tags:

    <tool>calculate(expression="2 + 3")</tool>
    <tool>{"name": "calculate", "arguments": {"expression": "2 + 3"}}</tool>

and the results come back in one user message of <tool_result name="..."> blocks (a template
that knows no tools knows no tool role either).

Parsing never raises, whatever the policy wrote: a call that cannot be read becomes a
`ToolCall` with `error` set, which the environment answers with an error result. That includes
a call block longer than `MAX_CALL_CHARS`, arguments nested deeper than `MAX_JSON_DEPTH`,
integers longer than Python reads from text (4300 digits), and anything that exhausts the
parsers (brackets nested thousands deep). A call left open at the end of the turn (the model
stopped inside it) is read as if closed.
"""

from __future__ import annotations

import ast
import contextlib
import json
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal, Protocol

from streamrl.envs.limits import MAX_JSON_DEPTH, nesting_depth
from streamrl.envs.tools import Tool, ToolCall, ToolResult

__all__ = [
    "MAX_CALL_CHARS",
    "TOOL_FORMATS",
    "HermesFormat",
    "Message",
    "TaggedFormat",
    "ToolFormat",
    "resolve_tool_format",
]

Message = dict[str, Any]
"""A chat message: {"role": "system" | "user" | "assistant" | "tool", "content": str}; a tool's
answer adds {"name": <the tool>}."""

MAX_CALL_CHARS = 16_384
"""Longest tool call read, in characters (one call block's text, stripped): room for a long
program for the python tool (~4k tokens); a longer block is answered with an error unread."""

_MAX_INT_DIGITS = sys.int_info.default_max_str_digits  # 4300: what int() reads from text
_TOO_LONG_INT = 10**_MAX_INT_DIGITS


class ToolFormat(Protocol):
    """One way of writing tool calls: what the template gets, what the model is told, how its
    calls are read and how results are answered."""

    name: str

    def template_tools(self, tools: Sequence[Tool]) -> list[dict[str, Any]] | None: ...

    def prompt(self, messages: list[Message], tools: Sequence[Tool]) -> list[Message]: ...

    def parse(self, text: str) -> list[ToolCall]: ...

    def format_call(self, name: str, arguments: dict[str, Any]) -> str: ...

    def observe(self, results: Sequence[ToolResult]) -> list[Message]: ...


def resolve_tool_format(setting: str, chat_template: str | None) -> Literal["hermes", "tagged"]:
    """`generator.env.tool_format` made definite: auto is hermes when the chat template
    mentions tools (it renders a `tools=` list), else tagged."""
    if setting in ("hermes", "tagged"):
        return setting  # type: ignore[return-value]
    if setting != "auto":
        raise ValueError(f"tool_format must be auto, hermes or tagged, got {setting!r}")
    return "hermes" if chat_template and re.search(r"\btools\b", chat_template) else "tagged"


def _blocks(text: str, opening: str, closing: str) -> list[str]:
    """The contents of every `opening ... closing` block; the last may be left open."""
    pattern = re.compile(rf"{re.escape(opening)}(.*?)(?:{re.escape(closing)}|\Z)", re.DOTALL)
    return [match.group(1).strip() for match in pattern.finditer(text)]


def _read(parse_one: Callable[[str], ToolCall], body: str) -> ToolCall:
    """`parse_one(body)` for a call block of at most `MAX_CALL_CHARS` whose arguments nest at
    most `MAX_JSON_DEPTH` deep; any other block becomes a call with `error` set."""
    if len(body) > MAX_CALL_CHARS:
        return ToolCall(
            "",
            error=f"the call is {len(body)} characters long; at most {MAX_CALL_CHARS}: write "
            "a shorter call",
        )
    try:
        call = parse_one(body)
    except (RecursionError, MemoryError, ValueError, OverflowError) as exc:  # module docstring
        return ToolCall(
            "",
            error=f"{type(exc).__name__} while reading it: write arguments nested at most "
            f"{MAX_JSON_DEPTH} deep, with integers of at most {_MAX_INT_DIGITS} digits",
        )
    if max(nesting_depth(call.arguments), nesting_depth(call.positional)) > MAX_JSON_DEPTH:
        return ToolCall(
            call.name,
            error=f"the arguments nest more than {MAX_JSON_DEPTH} levels deep; write them flatter",
        )
    return call


def _from_json(body: str) -> ToolCall:
    """A call written as {"name": ..., "arguments": {...}} (arguments may be a JSON string)."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall("", error=f"not valid JSON ({exc.msg} at character {exc.pos})")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return ToolCall("", error='expected a JSON object {"name": ..., "arguments": {...}}')
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError):  # then refused below, as a string
            arguments = json.loads(arguments) if arguments.strip() else {}
    if not isinstance(arguments, dict):
        return ToolCall(value["name"], error='"arguments" must be a JSON object')
    return ToolCall(value["name"], arguments)


class HermesFormat:
    """<tool_call>{json}</tool_call>, tools given to the chat template (module docstring)."""

    name: ClassVar[str] = "hermes"

    def template_tools(self, tools: Sequence[Tool]) -> list[dict[str, Any]] | None:
        return [t.schema for t in tools] if tools else None

    def prompt(self, messages: list[Message], tools: Sequence[Tool]) -> list[Message]:
        return list(messages)  # the chat template describes the tools

    def parse(self, text: str) -> list[ToolCall]:
        return [_read(_from_json, body) for body in _blocks(text, "<tool_call>", "</tool_call>")]

    def format_call(self, name: str, arguments: dict[str, Any]) -> str:
        """A call as a Qwen-style template writes an assistant's `tool_calls` (and as the model
        learned to write it)."""
        call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"<tool_call>\n{call}\n</tool_call>"

    def observe(self, results: Sequence[ToolResult]) -> list[Message]:
        return [{"role": "tool", "name": r.name, "content": r.content} for r in results]


class TaggedFormat:
    """<tool>name(arg=value)</tool> described in the system prompt (module docstring)."""

    name: ClassVar[str] = "tagged"

    def template_tools(self, tools: Sequence[Tool]) -> list[dict[str, Any]] | None:
        return None  # the system prompt describes them

    def prompt(self, messages: list[Message], tools: Sequence[Tool]) -> list[Message]:
        """`messages` with the tools described at the end of the system message (one is
        added when there is none)."""
        if not tools:
            return list(messages)
        text = self.system_prompt(tools)
        if messages and messages[0].get("role") == "system":
            first = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}
            return [first, *messages[1:]]
        return [{"role": "system", "content": text}, *messages]

    def system_prompt(self, tools: Sequence[Tool]) -> str:
        """What the model is told about the tools and how to call them."""
        example = tools[0]
        lines = [
            "You can use tools. To call one, write the call inside <tool></tool> tags, with "
            "Python-style arguments, for example:",
            self.format_call(example.name, _example_arguments(example)),
            "You may make several calls in one reply. Their results come back in <tool_result> "
            "tags. A reply without a tool call is your final answer.",
            "",
            "Tools:",
        ]
        for t in tools:
            lines.append(f"- {t.usage()}: {t.description}")
            for name, spec in t.parameters.get("properties", {}).items():
                if spec.get("description"):
                    lines.append(f"    {name}: {spec['description']}")
        return "\n".join(lines)

    def parse(self, text: str) -> list[ToolCall]:
        return [
            _read(_from_json if body.startswith("{") else _from_python, body)
            for body in _blocks(text, "<tool>", "</tool>")
        ]

    def format_call(self, name: str, arguments: dict[str, Any]) -> str:
        shown = ", ".join(f"{key}={_literal(value)}" for key, value in arguments.items())
        return f"<tool>{name}({shown})</tool>"

    def observe(self, results: Sequence[ToolResult]) -> list[Message]:
        blocks = [f'<tool_result name="{r.name}">\n{r.content}\n</tool_result>' for r in results]
        return [{"role": "user", "content": "\n".join(blocks)}]


def _from_python(body: str) -> ToolCall:
    """A call written as `name(arg=literal, ...)`; only literal arguments are read (nothing is
    evaluated: `ast.literal_eval` on each)."""
    try:
        node = ast.parse(body, mode="eval").body
    except SyntaxError as exc:
        return ToolCall("", error=f"not a call name(arg=value, ...) ({exc.msg})")
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        return ToolCall("", error="expected a call name(arg=value, ...)")
    name = node.func.id
    if any(_too_long_int(n) for n in ast.walk(node)):
        return ToolCall(name, error=f"an integer argument is longer than {_MAX_INT_DIGITS} digits")
    try:
        positional = tuple(ast.literal_eval(a) for a in node.args)
        keywords = {}
        for keyword in node.keywords:
            if keyword.arg is None:
                return ToolCall(name, error="**arguments are not allowed; name each argument")
            keywords[keyword.arg] = ast.literal_eval(keyword.value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return ToolCall(name, error="arguments must be literals (strings, numbers, lists, ...)")
    return ToolCall(name, keywords, positional)


def _too_long_int(node: ast.AST) -> bool:
    """An integer literal longer than JSON (and int()) reads: a hexadecimal one may be; it could
    not be printed in a message or a result."""
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int)
        and abs(node.value) >= _TOO_LONG_INT
    )


def _literal(value: Any) -> str:
    """A Python literal for `value`; strings in double quotes, as models usually write them."""
    return json.dumps(value, ensure_ascii=False) if isinstance(value, str) else repr(value)


def _example_arguments(example: Tool) -> dict[str, Any]:
    """The tool's own example, else a call with every argument of its signature: an optional
    one at its default, a required one at a placeholder of its type (an enum's first value)."""
    if example.example is not None:
        return example.example
    placeholders = {"string": "...", "integer": 1, "number": 1.5, "boolean": True,
                    "array": [], "object": {}}  # fmt: skip
    arguments = {}
    for name, spec in example.parameters.get("properties", {}).items():
        if "default" in spec:
            arguments[name] = spec["default"]
        elif spec.get("enum"):
            arguments[name] = spec["enum"][0]
        else:  # a list of types (["string", "null"]): the first's placeholder
            kind = spec.get("type")
            kind = kind[0] if isinstance(kind, list) and kind else kind
            arguments[name] = placeholders.get(kind, "...") if isinstance(kind, str) else "..."
    return arguments


TOOL_FORMATS: dict[str, ToolFormat] = {"hermes": HermesFormat(), "tagged": TaggedFormat()}
