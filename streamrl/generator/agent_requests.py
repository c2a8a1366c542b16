"""What an agent's chat-completions request must be before the generator's loop renders it,
checked on the endpoint's thread as the request arrives (`streamrl.generator.endpoint`).

An agent (the user's code, passing on what the policy wrote) can send anything; what the loop
then does with a request — render it with the chat template, describe its tools, tokenise it —
must not be able to fail on its form. So `parsed_request(body)` refuses, with a ValueError
naming the field and what it should be (the endpoint answers 400, and the episode goes on):

- a body that is not a JSON object, or nests more than `MAX_REQUEST_DEPTH` levels deep
  (recursion anywhere later walks a value one level per frame; Python stops at ~1000);
- `messages` that are not a list, or more than `MAX_REQUEST_MESSAGES` of them, before they
  are validated one by one;
- what vLLM's `ChatCompletionRequest` does not validate (whatever its validators raise);
- an assistant tool call whose `arguments` nest more than `MAX_JSON_DEPTH` levels deep (the
  depth the tool formats read, `streamrl.envs.formats`);
- tools whose schemas the tool formats cannot read, or whose `parameters.required` names an
  argument not in its `properties` (`streamrl.envs.schema_check`, as for an SFT row's tools).

Two more bounds live here for `AgentChat`: `arguments_too_deep`, so that the tool calls it
answers with are ones this check accepts when the agent sends them back, and
`most_chars_per_token`, by which a conversation too long for its episode's token budget is
refused before it is templated or tokenised.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from streamrl.envs.limits import MAX_JSON_DEPTH, nesting_depth
from streamrl.envs.schema_check import SchemaError, check_tool_schemas

__all__ = [
    "MAX_REQUEST_DEPTH",
    "MAX_REQUEST_MESSAGES",
    "arguments_too_deep",
    "most_chars_per_token",
    "parsed_request",
]

MAX_REQUEST_DEPTH = 100
"""Deepest nesting of a request body's JSON: room for a tool call's arguments or a tool's
schema at `MAX_JSON_DEPTH` inside the request's own few levels, far from Python's recursion
limit."""

MAX_REQUEST_MESSAGES = 4096

# Unicode normalisation (NFC, NFKC) composes at most 4 characters into one (a letter with
# three combining marks): text a normalising tokenizer reads may be that much shorter.
_MOST_COMPOSED = 4


def parsed_request(body: bytes) -> Any:
    """The body as vLLM's `ChatCompletionRequest`, checked (module docstring).

    Raises:
        ValueError: naming what is wrong with the request and how it should be.
    """
    from pydantic import ValidationError
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    try:
        data = json.loads(body)
    except RecursionError:
        raise ValueError(_too_deep("the request body", MAX_REQUEST_DEPTH)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"the request body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("the request body must be a JSON object")
    if nesting_depth(data, MAX_REQUEST_DEPTH) > MAX_REQUEST_DEPTH:
        raise ValueError(_too_deep("the request body", MAX_REQUEST_DEPTH))
    messages = data.get("messages")
    if not isinstance(messages, list):
        raise ValueError("messages must be a list of message objects")
    if len(messages) > MAX_REQUEST_MESSAGES:
        raise ValueError(f"{len(messages)} messages; at most {MAX_REQUEST_MESSAGES}")
    _check_arguments(messages)
    try:
        request = ChatCompletionRequest.model_validate(data)
    except ValidationError as invalid:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in invalid.errors()[:5]
        )
        raise ValueError(f"invalid chat completion request: {problems}") from None
    except Exception as invalid:  # deliberate: vLLM's validators raise TypeError and the like
        raise ValueError(f"invalid chat completion request: {invalid!r}"[:2000]) from None
    if request.tools:
        check_tool_schemas([t.model_dump(exclude_none=True) for t in request.tools])
    return request


def arguments_too_deep(arguments: Any) -> bool:
    """Whether a tool call's arguments (JSON text, or a value) nest deeper than the tool formats
    read (`MAX_JSON_DEPTH`). Text that is not JSON is not: it is refused, if ever, when the
    call is rendered (`streamrl.envs.conversations`)."""
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
    except RecursionError:  # the decoder recurses once per level: thousands deep
        return True
    except ValueError:
        return False
    return nesting_depth(value) > MAX_JSON_DEPTH


def most_chars_per_token(tokenizer: Any) -> int:
    """The most characters of text one token can stand for: its longest token's spelling (a
    byte-level token spells each byte it stands for as one character, and a character is at
    least one byte), `_MOST_COMPOSED` times that when the tokenizer normalises the text first.
    Tokenizers that spell any text so (byte-level, or byte fallback) are what chat models use;
    one that reads unknown text as a single <unk> is not bounded so."""
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    normalises = backend is None or backend.normalizer is not None
    return max(longest, 1) * (_MOST_COMPOSED if normalises else 1)


def _check_arguments(messages: list[Any]) -> None:
    """Refuse an assistant tool call whose arguments nest deeper than the tool formats read
    (in the body as sent: what is not shaped as a call is vLLM's to refuse)."""
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or message.get("role") != "assistant":
            continue
        calls = message.get("tool_calls")
        if not isinstance(calls, list):
            continue
        for k, call in enumerate(calls):
            function = call.get("function") if isinstance(call, Mapping) else None
            if isinstance(function, Mapping) and arguments_too_deep(function.get("arguments")):
                raise SchemaError(_too_deep(f"messages[{i}].tool_calls[{k}].function.arguments"))


def _too_deep(what: str, limit: int = MAX_JSON_DEPTH) -> str:
    return f"{what} nests more than {limit} levels deep; write it flatter"
