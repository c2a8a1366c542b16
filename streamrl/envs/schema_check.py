"""Checks on JSON that describes tools or calls them, made before anything renders or runs it:
a tools list (OpenAI-style function schemas), a JSON value's nesting, a JSON text.

Whoever hands these in — a row of an SFT dataset, an agent's request — may send anything: a
number where a list belongs, a list where an object does, arguments nested 100,000 deep. What
later reads them (the chat template's `tools=`, the tagged format's prompt, `Tool.usage`,
`json.dumps`, `repr`) would fail with a `TypeError`, `AttributeError` or `RecursionError`
naming nothing. Each check here raises `SchemaError`, a `ValueError` naming the tool or value
and the field, so a caller can answer with it (a dataset row, a 400 response).

- `check_tool_schemas`: a list of `{"type": "function", "function": {"name", "description",
  "parameters"}}` (or the inner objects); `parameters` a JSON schema in which every keyword the
  renderers read has its JSON-schema shape — `properties` an object of schemas, `required` a
  list of names, `enum` and `examples` lists, `type` a name or a list of names, `items`,
  `additionalProperties`, `not` a schema, `anyOf` / `oneOf` / `allOf` / `prefixItems` lists of
  schemas, `$defs` / `definitions` / `patternProperties` objects of schemas — and every schema
  nested at most `MAX_JSON_DEPTH` deep. The arguments `parameters.required` names must be among
  `parameters.properties`: the model is shown only the properties, so a required argument
  beyond them could never be passed. (A nested schema's `required` is not held to its own
  properties: an `anyOf` alternative may require what its parent declares.)
- `check_nesting`: a value nested at most `MAX_JSON_DEPTH` deep, counted without recursion
  (`streamrl.envs.limits.nesting_depth`).
- `loads_json`: `json.loads`, whose own recursion on a text nested thousands deep becomes a
  `SchemaError` too, then `check_nesting`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from streamrl.envs.limits import MAX_JSON_DEPTH, nesting_depth

__all__ = ["SchemaError", "check_nesting", "check_tool_schemas", "loads_json"]

_SCHEMA = ("items", "additionalProperties", "not", "contains", "propertyNames")
"""Keywords whose value is one schema: an object, or a boolean (true accepts anything); `items`
may also be a list of schemas (older drafts' tuples)."""
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
"""Keywords whose schemas (a list's, an object's values) must be objects: the renderers read
their fields (a property's description, type, enum, default; an alternative's type)."""
_TEXT = ("description", "title")


class SchemaError(ValueError):
    """A tools list or JSON value that cannot be used; the message names where and the field."""


def check_nesting(value: Any, where: str) -> None:
    """Refuse `value` when its lists and objects nest deeper than `MAX_JSON_DEPTH`."""
    if nesting_depth(value) > MAX_JSON_DEPTH:
        raise SchemaError(f"{where} nests more than {MAX_JSON_DEPTH} levels deep; write it flatter")


def loads_json(text: str, where: str) -> Any:
    """The JSON value of `text`, nested at most `MAX_JSON_DEPTH` deep."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SchemaError(f"{where} is not JSON ({exc.msg} at character {exc.pos})") from None
    except RecursionError:  # the decoder recurses once per level: thousands deep
        raise SchemaError(
            f"{where} nests more than {MAX_JSON_DEPTH} levels deep; write it flatter"
        ) from None
    check_nesting(value, where)
    return value


def check_tool_schemas(schemas: Any, where: str = "tools") -> None:
    """Refuse a tools list that is not a list of function schemas as the module docstring
    says, naming the tool (`tools[1] (lookup)`) and the field."""
    if not isinstance(schemas, list | tuple):
        raise SchemaError(f"{where} must be a list of tool schemas, got {_kind(schemas)}")
    for k, schema in enumerate(schemas):
        tool = f"{where}[{k}]"
        spec = schema.get("function", schema) if isinstance(schema, Mapping) else None
        if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
            raise SchemaError(f"{tool} is not a function schema with a name, got {_kind(schema)}")
        if spec is not schema and schema.get("type", "function") != "function":
            raise SchemaError(f'{tool}: type must be "function", got {schema["type"]!r:.40}')
        tool = f"{tool} ({spec['name'][:40]})"
        if not spec["name"]:
            raise SchemaError(f"{tool}: name is empty")
        if not isinstance(spec.get("description", ""), str):
            raise SchemaError(f"{tool}: description must be text, got {_kind(spec['description'])}")
        check_nesting(spec, tool)
        parameters = spec.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, Mapping):
                raise SchemaError(
                    f"{tool}: parameters must be a JSON schema object, got {_kind(parameters)}"
                )
            _check_schema(parameters, f"{tool}: parameters")
            _check_required_declared(parameters, f"{tool}: parameters")


def _check_required_declared(parameters: Mapping[str, Any], where: str) -> None:
    """Refuse a tool whose `required` names an argument its `properties` do not declare (its
    shapes already checked by `_check_schema`)."""
    declared = parameters.get("properties", {})
    unknown = [name for name in parameters.get("required", ()) if name not in declared]
    if unknown:
        raise SchemaError(
            f"{where}.required names {json.dumps(unknown[0][:40])}, which is not in its "
            "properties: declare it under properties or drop it from required"
        )


def _check_schema(root: Mapping[str, Any], where: str) -> None:
    """Every schema in `root` (nested at most `MAX_JSON_DEPTH`: `check_nesting` first) has the
    shape of the keywords the renderers read; walked with a stack, not recursion."""
    stack: list[tuple[Any, str, bool]] = [(root, where, False)]  # (schema, where, may be bool)
    while stack:
        schema, at, boolean = stack.pop()
        if boolean and isinstance(schema, bool):
            continue
        if not isinstance(schema, Mapping):
            raise SchemaError(f"{at} must be a schema (an object), got {_kind(schema)}")
        kind = schema.get("type")
        if kind is not None and not (
            isinstance(kind, str)
            or (isinstance(kind, list) and kind and all(isinstance(t, str) for t in kind))
        ):
            raise SchemaError(f"{at}.type must be a type name or a list of them, got {_kind(kind)}")
        required = schema.get("required")
        if required is not None and not (
            isinstance(required, list) and all(isinstance(n, str) for n in required)
        ):
            raise SchemaError(f"{at}.required must be a list of property names")
        for key in ("enum", "examples"):
            if key in schema and not isinstance(schema[key], list):
                raise SchemaError(f"{at}.{key} must be a list, got {_kind(schema[key])}")
        for key in _TEXT:
            if key in schema and not isinstance(schema[key], str):
                raise SchemaError(f"{at}.{key} must be text, got {_kind(schema[key])}")
        for key in _SCHEMA:
            if key == "items" and isinstance(schema.get(key), list):
                stack += [(s, f"{at}.items[{i}]", True) for i, s in enumerate(schema[key])]
            elif key in schema:
                stack.append((schema[key], f"{at}.{key}", True))
        for key in _SCHEMA_LISTS:
            if key in schema:
                if not isinstance(schema[key], list):
                    raise SchemaError(
                        f"{at}.{key} must be a list of schemas, got {_kind(schema[key])}"
                    )
                stack += [(s, f"{at}.{key}[{i}]", False) for i, s in enumerate(schema[key])]
        for key in _SCHEMA_MAPS:
            if key in schema:
                if not isinstance(schema[key], Mapping):
                    raise SchemaError(
                        f"{at}.{key} must be an object of schemas by name, got {_kind(schema[key])}"
                    )
                stack += [(s, f"{at}.{key}.{str(name)[:40]}", False)
                          for name, s in schema[key].items()]  # fmt: skip


def _kind(value: Any) -> str:
    """What `value` is, for a message: its JSON type name."""
    names = {dict: "an object", list: "a list", str: "text", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}  # fmt: skip
    return names.get(type(value), type(value).__name__)
