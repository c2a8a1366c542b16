"""Chat conversations as training tokens: what supervised fine-tuning learns from.

A conversation is a list of messages in the OpenAI / Hugging Face chat layout: `system`, `user`,
`assistant` (its `content`, and `tool_calls` — `{"type": "function", "function": {"name",
"arguments"}}`, arguments a JSON object or its JSON text) and `tool` (a tool's answer: `content`,
optionally `name`). `ConversationRenderer.render` turns one into token ids and a loss mask the
way an episode of the same conversation would reach the learner in RL (`streamrl.envs.chat`):

- the messages before the first assistant turn, with the tools described as the environment's
  tool format does (`streamrl.envs.formats`: the chat template's `tools=` for hermes, the
  system prompt for tagged), and the generation prompt;
- each assistant turn as the model would write it — its content, then each call written in the
  tool format (`format_call`) — and the template's end-of-turn token: loss mask 1;
- the messages between assistant turns (tool results answered as the format answers them,
  `observe`; user turns) as the template's delta after the turn: loss mask 0.

So the model is taught to write exactly the calls its environment parses, followed by the token
that ends its turn, and the token history is the one RL continues. Templates that rewrite
earlier turns are refused (`TemplateNotAppendOnlyError`), as for multi-turn episodes. Every
problem with a conversation raises `ConversationError` naming the message and what is wrong:
its shape is checked before anything is rendered — messages objects with a known role and text
content, `tool_calls` a list of calls each with a function name and arguments (a JSON object or
its text) nested at most `MAX_JSON_DEPTH` deep, tools' schemas as `streamrl.envs.schema_check`
checks them — so a malformed row never reaches the template as a `TypeError`.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from streamrl.envs.chat import ChatRenderer
from streamrl.envs.formats import TOOL_FORMATS, Message, ToolFormat
from streamrl.envs.schema_check import SchemaError, check_nesting, check_tool_schemas, loads_json
from streamrl.envs.tools import Tool, ToolResult

__all__ = [
    "ConversationError",
    "ConversationRenderer",
    "RenderedConversation",
    "answered",
    "assistant_text",
    "tools_from_schemas",
]

ROLES = ("system", "user", "assistant", "tool")


class ConversationError(ValueError):
    """A conversation that cannot be trained on; the message names the message and the fix."""


@dataclass(frozen=True)
class RenderedConversation:
    """`token_ids` `[L] int32`; `loss_mask` `[L] uint8`, 1 at the assistant's own tokens (its
    turns and their end-of-turn tokens); `prompt_length`: the tokens before the first of them."""

    token_ids: np.ndarray
    loss_mask: np.ndarray
    prompt_length: int

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


class ConversationRenderer:
    """Renders conversations for one tokenizer and one tool format ("hermes" or "tagged")."""

    def __init__(self, tokenizer: Any, tool_format: str, model_name: str = "the model") -> None:
        if tool_format not in TOOL_FORMATS:
            raise ValueError(
                f"tool format must be one of {sorted(TOOL_FORMATS)}, not {tool_format!r}"
            )
        self.chat = ChatRenderer(tokenizer, model_name)
        self.format = TOOL_FORMATS[tool_format]
        self.tokenizer = tokenizer
        eos_text = self.chat.eos_text()
        if not eos_text:
            raise ConversationError(
                f"the chat template of {model_name} closes an assistant turn without an "
                "end-of-turn token, so the model could not learn where its turn ends"
            )
        self.end_of_turn = self.chat.encode(eos_text)

    def render(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool] = ()
    ) -> RenderedConversation:
        """Token ids and loss mask of `messages` (module docstring), with `tools` offered."""
        turns = _checked(messages)
        first = next(i for i, m in enumerate(turns) if m["role"] == "assistant")
        context = self.format.prompt(turns[:first], list(tools)) if tools else turns[:first]
        template_tools = self.format.template_tools(list(tools)) if tools else None
        ids = self.chat.prompt_ids(context, template_tools)
        prompt_length, mask = len(ids), [0] * len(ids)
        i = first
        while i < len(turns):
            text = self.chat.encode(self._assistant_text(turns[i], i)) + self.end_of_turn
            ids += text
            mask += [1] * len(text)
            j = i + 1
            while j < len(turns) and turns[j]["role"] != "assistant":
                j += 1
            if j < len(turns):  # what the environment answered, up to the next turn
                between = self._observation(turns[i + 1 : j], i + 1)
                observed = self.chat.observation_ids(between, ended_with_eos=True)
                ids += observed
                mask += [0] * len(observed)
            elif j > i + 1:
                raise ConversationError(
                    f"message {i + 1} ({turns[i + 1]['role']}) comes after the last assistant "
                    "turn: nothing would learn from it; end the conversation with the "
                    "assistant's turn"
                )
            i = j
        return RenderedConversation(
            np.asarray(ids, np.int32), np.asarray(mask, np.uint8), prompt_length
        )

    def _assistant_text(self, message: Mapping[str, Any], index: int) -> str:
        text = assistant_text(self.format, message, f"message {index}")
        if not text:
            raise ConversationError(
                f"message {index} (assistant) has neither content nor tool calls"
            )
        return text

    def _observation(
        self, messages: Sequence[Mapping[str, Any]], start: int
    ) -> list[dict[str, Any]]:
        """The messages between two assistant turns as the environment gives them: tool results
        answered as the tool format answers them (consecutive ones together), others as they
        are."""
        for offset, message in enumerate(messages):
            if message["role"] == "system":
                raise ConversationError(
                    f"message {start + offset} is a system message after the conversation "
                    "began; put the system message first"
                )
        return answered(self.format, messages)


def assistant_text(tool_format: ToolFormat, message: Mapping[str, Any], where: str) -> str:
    """An assistant turn as the model writes it: its content, then each call in the tool
    format, a line each (empty for neither)."""
    parts = [message["content"]] if message.get("content") else []
    for k, call in enumerate(_tool_calls(message, where)):
        name, arguments = _call(call, f"{where} tool_calls[{k}]")
        parts.append(tool_format.format_call(name, arguments))
    return "\n".join(parts)


def answered(tool_format: ToolFormat, messages: Sequence[Mapping[str, Any]]) -> list[Message]:
    """Messages other than the assistant's as the environment gives them: tool results
    answered as the tool format answers them (consecutive ones together, each named by its
    `name`), others as they are."""
    out: list[Message] = []
    results: list[ToolResult] = []
    for message in messages:
        if message["role"] == "tool":
            results.append(ToolResult(str(message.get("name") or "tool"), message["content"]))
            continue
        if results:
            out += tool_format.observe(results)
            results = []
        out.append({"role": message["role"], "content": message["content"]})
    if results:
        out += tool_format.observe(results)
    return out


def tools_from_schemas(schemas: Sequence[Mapping[str, Any]], where: str = "tools") -> list[Tool]:
    """`Tool`s described by OpenAI-style schemas (`{"type": "function", "function": {"name",
    "description", "parameters"}}`, or the inner object): what the model is shown of them.
    They cannot be run (a demonstration carries its tools' answers; an agent runs its own).
    The parameters' JSON-schema `examples[0]` is the call the tagged format shows."""
    try:
        check_tool_schemas(schemas, where)
    except SchemaError as problem:
        raise ConversationError(str(problem)) from None
    tools = []
    for schema in schemas:
        spec = schema.get("function", schema)
        parameters = dict(spec.get("parameters") or {"type": "object", "properties": {}})
        examples = parameters.get("examples")
        example = examples[0] if isinstance(examples, list) and examples else None
        if not isinstance(example, Mapping):
            example = None
        tools.append(
            Tool(spec["name"], str(spec.get("description", "")), parameters, _not_run, example)
        )
    return tools


def _not_run(**_: Any) -> Any:
    raise RuntimeError("a tool described by a schema only is not run")


def _checked(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ConversationError("a conversation is a non-empty list of messages")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or message.get("role") not in ROLES:
            raise ConversationError(
                f"message {i} needs a role of {', '.join(ROLES)}, got {_excerpt(message)}"
            )
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise ConversationError(
                f"message {i} ({message['role']}): content must be text, got "
                f"{type(content).__name__}"
            )
        if message["role"] != "assistant" and not isinstance(content, str):
            raise ConversationError(f"message {i} ({message['role']}) has no content")
        where = f"message {i} ({message['role']})"
        calls = _tool_calls(message, where)
        if calls and message["role"] != "assistant":
            raise ConversationError(f"{where} has tool_calls; only assistant messages make calls")
        for k, call in enumerate(calls):
            _call(call, f"{where} tool_calls[{k}]")
        if message.get("name") is not None and not isinstance(message["name"], str):
            raise ConversationError(
                f"{where}: name must be text, got {type(message['name']).__name__}"
            )
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise ConversationError("the conversation has no assistant message: nothing to learn")
    if roles[0] == "assistant":
        raise ConversationError(
            "message 0 is the assistant's: a conversation starts with a system or user message"
        )
    if "system" in roles[1:] and roles.index("system", 1) < roles.index("assistant"):
        raise ConversationError(
            f"message {roles.index('system', 1)} is a second system message; "
            "merge it into the first"
        )
    return list(messages)


def _tool_calls(message: Mapping[str, Any], where: str) -> Sequence[Any]:
    """A message's `tool_calls`: a list (none: empty)."""
    calls = message.get("tool_calls")
    if calls is None:
        return ()
    if not isinstance(calls, list | tuple):
        raise ConversationError(
            f"{where}: tool_calls must be a list of calls, got {type(calls).__name__} "
            f"{_excerpt(calls)}"
        )
    return calls


def _call(call: Any, where: str) -> tuple[str, dict[str, Any]]:
    """A tool call's name and arguments (a JSON object, or its JSON text), nested at most
    `MAX_JSON_DEPTH` deep."""
    spec = call.get("function", call) if isinstance(call, Mapping) else None
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise ConversationError(f"{where} needs a function name, got {_excerpt(call)}")
    arguments, at = spec.get("arguments", {}), f"{where}.function.arguments"
    try:
        if isinstance(arguments, str):
            arguments = loads_json(arguments, at) if arguments.strip() else {}
        check_nesting(arguments, at)
    except SchemaError as problem:
        raise ConversationError(str(problem)) from None
    if not isinstance(arguments, Mapping):
        raise ConversationError(
            f"{at} must be a JSON object (or its text), got {type(arguments).__name__}"
        )
    return spec["name"], dict(arguments)


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60


def _excerpt(value: Any) -> str:
    """`value` for a message, cut to 80 characters; bounded in depth too, so a value nested
    thousands deep prints (`repr` would recurse once per level)."""
    text = _REPR.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
