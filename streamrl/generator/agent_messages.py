"""What of an agent's chat-completions request is served, and its messages read as plain data,
for `streamrl.generator.agent_chat` to render into the episode's token history.

- Sampling is the run's: `check_sampling` refuses a request that asks for another temperature,
  top-p, penalties, stop strings, top log-probs, constrained decoding, more than one choice or
  a streamed answer (`RequestRefusedError`, naming the setting and how to call instead), since
  the learner's importance weights need the behaviour policy's log-probs. A setting at its
  default, or one that does not change what is sampled (the model's name, a seed, `logprobs`,
  `max_tokens`, which can only lower the turn's budget), is served.
- `normalized`: a message as plain data — its role (developer read as system), its text (text
  parts joined; any other part refused), an assistant's tool calls (arguments as JSON text) or
  a tool result's call id. A message of another role or shape is refused naming what it is.
- `message_key`: what makes two messages the same turn — role, text, and tool calls by name and
  arguments as JSON values; not the calls' ids, nor how the client serialised the arguments.
- `request_tools`: the request's tools as the chat template's `tools=` list (none when
  `tool_choice` is "none"); `tool_names`: each call id's tool, to name the tool results.

`RequestRefusedError` is how a request is refused, here and by `AgentChat`: the endpoint
answers with its status and message, and one that ended the episode carries the error code
`EPISODE_ENDED`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from streamrl.envs.agent import EPISODE_ENDED
from streamrl.generator.config import GeneratorConfig

__all__ = [
    "MessageKey",
    "RequestRefusedError",
    "check_sampling",
    "message_key",
    "normalized",
    "request_tools",
    "tool_names",
]

# Set in a request without changing what is sampled: read, or ignored.
_HARMLESS = frozenset(
    {"messages", "model", "tools", "max_tokens", "max_completion_tokens", "seed", "user",
     "parallel_tool_calls", "stream_options", "return_token_ids", "request_id", "logprobs",
     "include_reasoning", "reasoning_effort"}
)  # fmt: skip
_NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}
_FIX = "leave it unset: the learner's importance weights need the run's own sampling"

MessageKey = tuple[str, str, tuple[tuple[str, str], ...]]
"""A message's role, text, and tool calls as (name, arguments as sorted JSON)."""


class RequestRefusedError(Exception):
    """A request the endpoint answers with an error (`status`, the message saying why);
    `ended`: the refusal ended the episode (`code` is then `EPISODE_ENDED`)."""

    def __init__(self, message: str, status: int = 400, *, ended: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.code = EPISODE_ENDED if ended else None


def check_sampling(request: Any, generator: GeneratorConfig) -> None:
    """Refuse a request that asks for other sampling than the run's (module docstring)."""
    for name in sorted(request.model_fields_set & set(type(request).model_fields)):
        value = vars(request).get(name)  # `max_tokens` as an attribute warns
        if name in _HARMLESS or value is None:
            continue
        if name == "temperature" and math.isclose(value, generator.temperature, rel_tol=1e-6):
            continue
        if name == "top_p" and math.isclose(value, generator.top_p, rel_tol=1e-6):
            continue
        if name == "n" and value == 1:
            continue
        if name == "top_logprobs" and value == 0:
            continue
        if name == "stream" and not value:
            continue
        if name == "tool_choice" and value in ("auto", "none"):
            continue
        if _NEUTRAL.get(name) == value:
            continue
        if value == type(request).model_fields[name].default:
            continue
        raise RequestRefusedError(_refusal(name, value, generator))


def normalized(message: Any) -> dict[str, Any]:
    """A request message as plain data: role (developer read as system), text content (parts
    joined; only text parts), and an assistant's tool calls or a tool result's call id."""
    if not isinstance(message, Mapping):
        raise RequestRefusedError(f"a message must be an object, got {type(message).__name__}")
    role = message.get("role")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise RequestRefusedError(
            f"message role {role!r} is not served (system, user, assistant, tool)"
        )
    out: dict[str, Any] = {"role": role, "content": _text(message.get("content"))}
    if role == "assistant" and message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            function = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
                raise RequestRefusedError(
                    "an assistant tool call needs function.name and function.arguments"
                )
            arguments = function.get("arguments", "{}")
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments)
            called = {"name": function["name"], "arguments": arguments}
            calls.append({"id": call.get("id", ""), "type": "function", "function": called})
        out["tool_calls"] = calls
    if role == "tool":
        out["tool_call_id"] = str(message.get("tool_call_id", ""))
    return out


def message_key(message: Mapping[str, Any]) -> MessageKey:
    """What makes two (normalized) messages the same turn: role, text and tool calls (name and
    arguments as JSON values; not their ids, nor how the client serialised them)."""
    calls = tuple(
        (c["function"]["name"], json.dumps(_arguments(c["function"]["arguments"]), sort_keys=True))
        for c in message.get("tool_calls") or ()
    )
    return (message["role"], message["content"] or "", calls)


def request_tools(request: Any) -> list[dict[str, Any]] | None:
    """The request's tools as the template's `tools=` list; None without any, or when
    `tool_choice` is "none"."""
    if not request.tools or request.tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in request.tools]


def tool_names(messages: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Tool call id → the tool's name, over the assistant messages' calls."""
    return {
        c["id"]: c["function"]["name"]
        for m in messages
        for c in m.get("tool_calls") or ()
        if c.get("id")
    }


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Iterable) and not isinstance(content, Mapping):  # vLLM's iterator too
        parts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text"):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise RequestRefusedError(f"only text content is served, not {kind!r}")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise RequestRefusedError(f"message content must be text, got {type(content).__name__}")


def _arguments(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (json.JSONDecodeError, RecursionError):
        return arguments


def _refusal(name: str, value: Any, cfg: GeneratorConfig) -> str:
    shown = json.dumps(value, default=str)[:80]
    if name in ("temperature", "top_p"):
        return (
            f"{name}={shown}: this run samples at generator.{name}={getattr(cfg, name):g}; {_FIX}"
        )
    if name == "n":
        return f"n={shown}: one choice per request; send more requests for more samples"
    if name == "stream":
        return "stream=true: streaming responses are not served; call with stream=false"
    if name == "tool_choice":
        return (
            f"tool_choice={shown}: only auto and none are served; a forced call would need "
            "constrained decoding, which changes the sampled distribution"
        )
    if name == "top_logprobs":
        return (
            f"top_logprobs={shown}: only the sampled tokens' log-probs are served (logprobs=true)"
        )
    return f"{name}={shown}: not served, it changes what is sampled; {_FIX}"
