"""Tools: Python functions a model may call, described by a JSON schema of their arguments.

`tool(fn)` makes a `Tool` from a plain function: its name, its docstring's first paragraph as
the description, and a JSON schema derived from its type hints (str, int, float, bool, lists,
dicts, Literal, Optional) with each argument's description taken from the docstring's `Args:`
section and an optional argument's default as the schema's `default`. A schema can be given
instead (`tool(fn, parameters={...})`). What the model would be shown blind is refused
(`ToolDefinitionError`): a function without a docstring (and no `description=`) or an argument
without a type hint (and no `parameters=`). `Tool.schema` is the OpenAI-style entry of a chat
template's `tools=` list.

`Tool.run(call)` checks a parsed call's arguments against the schema and runs the function;
every way a call can go wrong — a call that could not be parsed, an unknown tool, missing,
unknown or mistyped arguments, a function that raises or returns what cannot be written as
JSON — becomes an error result the model reads as the tool's answer, never an exception in the
environment. What a result echoes of the model's call is bounded: a tool name to
`MAX_TOOL_NAME_CHARS`, an argument's value to a short excerpt, the whole result to `max_chars`.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from streamrl.envs.limits import truncate

__all__ = [
    "MAX_TOOL_NAME_CHARS",
    "Tool",
    "ToolCall",
    "ToolDefinitionError",
    "ToolResult",
    "as_tool",
    "run_tool_call",
    "tool",
    "truncate",
]

MAX_TOOL_NAME_CHARS = 64
"""Longest tool name echoed back to the model (an unknown tool's, in its error result)."""

_JSON_TYPES: dict[type, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


class ToolDefinitionError(ValueError):
    """A function cannot be described to the model as a tool; the message names the tool, what
    is missing and how to give it."""


@dataclass(frozen=True)
class ToolCall:
    """One tool call as parsed from the model's text. `error` is set when the call could not
    be parsed (its `name` may then be empty); `positional` holds arguments given without a
    name (the tagged format allows them), bound to the schema's parameters in order."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    positional: tuple[Any, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class ToolResult:
    """A tool's answer to one call: `content` is what the model reads; `ok` False for an
    error (malformed call, unknown tool, bad arguments, the tool raised)."""

    name: str
    content: str
    ok: bool = True


@dataclass(frozen=True)
class Tool:
    """A function the model may call: `parameters` is the JSON schema of its arguments (an
    object schema whose properties are in the function's parameter order); `example`: some
    arguments to show the model (the tagged format's prompt does)."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any]
    example: dict[str, Any] | None = None

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI-style description a chat template's `tools=` list takes (its example as
        the parameters' JSON-schema `examples`)."""
        parameters = self.parameters
        if self.example is not None:
            parameters = {**parameters, "examples": [self.example]}
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": parameters,
            },
        }

    def run(self, call: ToolCall, max_chars: int) -> ToolResult:
        """Check `call`'s arguments and run the function; its return value as text (JSON for
        anything but a string), cut to `max_chars`. Problems come back as error results."""
        try:
            arguments = self._bind(call)
        except ValueError as problem:
            return _error(self.name, f"{problem}. Usage: {self.usage()}", max_chars)
        try:
            value = self.fn(**arguments)
            text = value if isinstance(value, str) else json.dumps(value, default=str)
        except Exception as exc:  # deliberate: the model reads what its call did wrong
            return _error(self.name, f"{type(exc).__name__}: {exc}", max_chars)
        return ToolResult(self.name, truncate(text, max_chars))

    def usage(self) -> str:
        """`name(arg: type, ...)`, for error messages and the tagged format's prompt."""
        properties = self.parameters.get("properties", {})
        required = set(self.parameters.get("required", ()))
        shown = [
            f"{name}: {_type_text(spec)}" + _optional(spec, name in required)
            for name, spec in properties.items()
        ]
        return f"{self.name}({', '.join(shown)})"

    def _bind(self, call: ToolCall) -> dict[str, Any]:
        properties: dict[str, Any] = self.parameters.get("properties", {})
        names = list(properties)
        if len(call.positional) > len(names):
            raise ValueError(f"{len(call.positional)} positional arguments, {len(names)} taken")
        arguments = dict(zip(names, call.positional, strict=False))
        for name, value in call.arguments.items():
            if name in arguments:
                raise ValueError(f"argument '{name}' given twice")
            arguments[name] = value
        unknown = sorted(set(arguments) - set(properties))
        if unknown and not self.parameters.get("additionalProperties", False):
            raise ValueError(f"unknown argument '{unknown[0]}'")
        missing = [n for n in self.parameters.get("required", ()) if n not in arguments]
        if missing:
            raise ValueError(f"missing argument '{missing[0]}'")
        for name, value in arguments.items():
            if name in properties and (problem := _mismatch(value, properties[name])):
                raise ValueError(f"argument '{name}' {problem}")
        return arguments


def tool(
    fn: Callable[..., Any],
    *,
    name: str | None = None,
    description: str | None = None,
    parameters: Mapping[str, Any] | None = None,
    example: Mapping[str, Any] | None = None,
) -> Tool:
    """A `Tool` for `fn`, its schema derived from type hints and docstring unless given.

    Raises:
        ToolDefinitionError: `fn` has no docstring and no `description` is given, or an
            argument has no type hint and no `parameters` are given.
    """
    name = name or fn.__name__
    doc = inspect.getdoc(fn) or ""
    if parameters is None:
        parameters = _schema_of(fn, _argument_docs(doc), name)
    if description is None:
        description = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
        if not description:
            raise ToolDefinitionError(
                f"tool {name!r} has no docstring: the model reads its first paragraph as what "
                f"the tool does. Write one (and an Args: section describing each argument), or "
                f"pass tool({fn.__name__}, description=...)"
            )
    shown = None if example is None else dict(example)
    return Tool(name, description, dict(parameters), fn, shown)


def as_tool(item: Tool | Callable[..., Any]) -> Tool:
    """`item` itself if it is a `Tool`, else `tool(item)`."""
    return item if isinstance(item, Tool) else tool(item)


def run_tool_call(tools: Mapping[str, Tool], call: ToolCall, max_chars: int) -> ToolResult:
    """Run one parsed call against `tools` (by name): a malformed call or an unknown tool is
    answered with an error result."""
    name = _short_name(call.name)
    if call.error is not None:
        message = f"the tool call could not be read: {call.error}"
        return _error(name or "tool", message, max_chars)
    if call.name not in tools:
        known = ", ".join(sorted(tools)) or "none"
        return _error(name, f"unknown tool '{name}'; the tools are: {known}", max_chars)
    return tools[call.name].run(call, max_chars)


def _short_name(name: str) -> str:
    """A tool name as the model wrote it, cut to `MAX_TOOL_NAME_CHARS`."""
    return name if len(name) <= MAX_TOOL_NAME_CHARS else name[: MAX_TOOL_NAME_CHARS - 3] + "..."


def _type_text(spec: Mapping[str, Any]) -> str:
    """An argument's type as `usage` shows it: the JSON type, an enum's values (`"m" | "ft"`),
    the alternatives of an anyOf, or `any`."""
    if spec.get("enum"):
        return " | ".join(_excerpt(v) if not isinstance(v, str) else json.dumps(v)
                          for v in spec["enum"])  # fmt: skip
    if spec.get("anyOf"):
        return " | ".join(_type_text(s) for s in spec["anyOf"])
    kind = spec.get("type", "any")
    return kind if isinstance(kind, str) else " | ".join(map(str, kind))


def _optional(spec: Mapping[str, Any], required: bool) -> str:
    """How `usage` marks an argument that may be left out: its default, when the schema has one."""
    if required:
        return ""
    return f" = {_excerpt(spec['default'])}" if "default" in spec else " (optional)"


def _error(name: str, message: str, max_chars: int) -> ToolResult:
    return ToolResult(name, truncate(f"Error: {message}", max_chars), ok=False)


def _excerpt(value: Any) -> str:
    """`repr(value)` cut to 80 characters, for a message about a model's argument."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# -- the schema of a function's arguments ----------------------------------------------------


def _schema_of(fn: Callable[..., Any], docs: Mapping[str, str], name: str) -> dict[str, Any]:
    hints = typing.get_type_hints(fn)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for parameter in inspect.signature(fn).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if parameter.name not in hints:
            raise ToolDefinitionError(
                f"tool {name!r}: argument {parameter.name!r} has no type hint, so the model "
                f"would not know what to pass. Annotate it ({parameter.name}: str, int, float, "
                f"bool, list[...], Literal[...]), or pass tool({fn.__name__}, parameters=<JSON "
                "schema>)"
            )
        spec = _json_schema(hints[parameter.name])
        if parameter.name in docs:
            spec["description"] = docs[parameter.name]
        if parameter.default is parameter.empty:
            required.append(parameter.name)
        elif _is_json(parameter.default):
            spec["default"] = parameter.default
        properties[parameter.name] = spec
    return {"type": "object", "properties": properties, "required": required}


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def _json_schema(hint: Any) -> dict[str, Any]:
    """The JSON schema of a type hint; `Any` and unknown types are left unconstrained."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        present = [a for a in args if a is not type(None)]
        if len(present) == 1:
            return _json_schema(present[0])
        return {"anyOf": [_json_schema(a) for a in present]}
    if hint in (list, tuple) or origin in (list, tuple, Sequence):
        return {"type": "array", **({"items": _json_schema(args[0])} if args else {})}
    if hint is dict or origin in (dict, Mapping):
        return {"type": "object"}
    return {}


_ARGS_HEADER = re.compile(r"^(Args|Arguments|Parameters):\s*$")
_ARG_LINE = re.compile(r"^\s+(\w+)(?:\s*\([^)]*\))?:\s*(.*)$")


def _argument_docs(doc: str) -> dict[str, str]:
    """Each argument's description from a Google-style `Args:` section."""
    docs: dict[str, str] = {}
    current: str | None = None
    in_args = False
    for line in doc.splitlines():
        if _ARGS_HEADER.match(line):
            in_args = True
        elif in_args and line and not line[0].isspace():
            in_args = False  # the next section
        elif in_args and (match := _ARG_LINE.match(line)):
            current = match.group(1)
            docs[current] = match.group(2).strip()
        elif in_args and current and line.strip():
            docs[current] = f"{docs[current]} {line.strip()}"
    return docs


def _mismatch(value: Any, spec: Mapping[str, Any]) -> str | None:
    """Why `value` does not fit `spec` (the JSON schema keywords type, enum, items, anyOf),
    or None; keywords beyond those are not checked."""
    if "enum" in spec and value not in spec["enum"]:
        return f"must be one of {spec['enum']}, got {_excerpt(value)}"
    if "anyOf" in spec and all(_mismatch(value, s) for s in spec["anyOf"]):
        return f"has the wrong type ({type(value).__name__})"
    kind = spec.get("type")
    expected = {
        "string": str, "integer": int, "number": (int, float), "boolean": bool,
        "array": list, "object": dict, "null": type(None),
    }.get(kind) if isinstance(kind, str) else None  # fmt: skip
    if expected is None:
        return None
    if not isinstance(value, expected) or (isinstance(value, bool) and kind != "boolean"):
        return f"must be {kind}, got {type(value).__name__} {_excerpt(value)}"
    if kind == "array" and "items" in spec:
        for item in value:
            if problem := _mismatch(item, spec["items"]):
                return f"item {problem}"
    return None
