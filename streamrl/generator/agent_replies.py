"""A sampled turn written back to the agent as a chat completion: `AgentChat.reply`
(`streamrl.generator.agent_chat`) records the turn in the episode's token history, reads its
tool calls with `tool_calls` and answers with `chat_completion`.

- Tool calls in the sampled text come back as `tool_calls` when the request offers tools
  (`streamrl.generator.agent_messages.request_tools`): read by vLLM's tool parser for the
  template's format (hermes, or `generator.env.tool_parser`), or by streamrl's tagged format
  (`streamrl.envs.formats.TaggedFormat`, positional arguments named after the tool's properties
  in order) when the template knows no tools. A call that cannot be read — malformed, of a
  tool not offered, with more positional arguments than the tool has properties, or with
  arguments nested deeper than the tool formats read (so that no call answered here is refused
  when the agent sends it back: `streamrl.generator.agent_requests.arguments_too_deep`) — is
  left out; the message's content is the text before the calls (None when empty), or the
  whole text when no call could be read.
- `logprobs`, when the request asks: each sampled token's text, log-prob and UTF-8 bytes, with
  no alternatives (`top_logprobs` is refused, `streamrl.generator.agent_messages`).
- `usage` counts the current segment: the prompt is every token before the turn.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Any

from streamrl.envs.formats import TaggedFormat
from streamrl.generator.agent_messages import request_tools
from streamrl.generator.agent_requests import arguments_too_deep
from streamrl.generator.engine import Completion

__all__ = ["chat_completion", "tool_calls"]


def tool_calls(
    text: str, request: Any, *, tagged: bool, tool_parser: str, tokenizer: Any
) -> tuple[str | None, list[dict[str, Any]]]:
    """The turn's text before its tool calls (None when empty), and the calls (module
    docstring); `tagged`: read in streamrl's tagged format, else by vLLM's `tool_parser`."""
    tools = request_tools(request)
    if not tools:
        return text, []
    if tagged:
        return _tagged_calls(text, tools)
    from vllm.tool_parsers import ToolParserManager

    parser = ToolParserManager.get_tool_parser(tool_parser)(tokenizer, tools=request.tools)
    found = parser.extract_tool_calls(text, request)
    # A call nested deeper than the tool formats read stays text: echoed back, the
    # endpoint would refuse it (`streamrl.generator.agent_requests`).
    readable = [c for c in found.tool_calls if not arguments_too_deep(c.function.arguments)]
    if not found.tools_called or not readable:
        return text, []
    calls = [
        {"id": c.id, "type": "function",
         "function": {"name": c.function.name, "arguments": c.function.arguments}}
        for c in readable
    ]  # fmt: skip
    return found.content or None, calls


def chat_completion(
    request: Any,
    message: dict[str, Any],
    completion: Completion,
    *,
    total_tokens: int,
    model_name: str,
    tokenizer: Any,
) -> dict[str, Any]:
    """The chat completion answering `request` with `message`, the sampled `completion` (the
    last turn of a segment now `total_tokens` long)."""
    truncated = completion.truncated
    finish = "length" if truncated else "tool_calls" if message.get("tool_calls") else "stop"
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
    choice["logprobs"] = _logprobs(completion, tokenizer) if request.logprobs else None
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.model or model_name,
        "choices": [choice],
        "usage": {
            "prompt_tokens": total_tokens - len(completion.token_ids),
            "completion_tokens": len(completion.token_ids),
            "total_tokens": total_tokens,
        },
    }


def _tagged_calls(
    text: str, tools: Sequence[Mapping[str, Any]]
) -> tuple[str | None, list[dict[str, Any]]]:
    """Calls written in the tagged format; those that cannot be read stay in the text only."""
    parameters = {
        t["function"]["name"]: list(t["function"].get("parameters", {}).get("properties", {}))
        for t in tools
    }
    calls = []
    for call in TaggedFormat().parse(text):
        names = parameters.get(call.name)
        if call.error is not None or names is None or len(call.positional) > len(names):
            continue
        arguments = {**dict(zip(names, call.positional, strict=False)), **call.arguments}
        called = {"name": call.name, "arguments": json.dumps(arguments)}
        calls.append(
            {"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": called}
        )
    if not calls:
        return text, []
    content = text[: text.find("<tool>")].rstrip()
    return content or None, calls


def _logprobs(completion: Completion, tokenizer: Any) -> dict[str, Any]:
    content = []
    for token_id, logprob in zip(completion.token_ids, completion.logprobs, strict=True):
        token = tokenizer.decode([int(token_id)])
        content.append({"token": token, "logprob": float(logprob),
                        "bytes": list(token.encode()), "top_logprobs": []})  # fmt: skip
    return {"content": content}
