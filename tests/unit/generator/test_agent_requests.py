"""What an agent may send, as an attacker would send it: requests checked as they arrive
(`parsed_request`: tool schemas the tool formats could not describe, JSON nested past the
limits, too many messages), and what `AgentChat` refuses before it could fail — a chat
template's `raise_exception`, a conversation too long for the budget before it is templated,
a policy's tool call nested too deep to be echoed back. With the tiny model's real tokenizer."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from streamrl.envs.agent import EPISODE_ENDED
from streamrl.envs.chat import ChatRenderer
from streamrl.envs.config import EnvConfig
from streamrl.envs.limits import MAX_JSON_DEPTH
from streamrl.generator.agent_chat import AgentChat, AgentEpisode
from streamrl.generator.agent_messages import RequestRefusedError
from streamrl.generator.agent_requests import (
    MAX_REQUEST_DEPTH,
    MAX_REQUEST_MESSAGES,
    most_chars_per_token,
    parsed_request,
)
from streamrl.generator.config import GeneratorConfig
from streamrl.generator.engine import Completion
from streamrl.models import resolve_model_path
from tests.unit.generator.conftest import QWEN25_TEMPLATE

USER = {"role": "user", "content": "What is 2+3?"}
CALCULATE = {
    "type": "object",
    "properties": {"expression": {"type": "string", "description": "The expression."}},
    "required": ["expression"],
}


def _tool(parameters: Any, name: str = "calculate") -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": name, "description": "d", "parameters": parameters},
    }


def _body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [USER], **fields}).encode()


def _nested(depth: int) -> str:
    """JSON text nested `depth` lists deep (built as text: dumping it would recurse)."""
    return "[" * depth + "]" * depth


def _call(arguments: str) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        ],
    }


def _chat(tokenizer: Any, tool_format: str = "tagged", max_episode_tokens: int = 8192) -> AgentChat:
    return AgentChat(
        ChatRenderer(tokenizer),
        GeneratorConfig(),
        EnvConfig(),
        tool_format,
        max_episode_tokens,
        "m",
    )


# -- checked as they arrive --------------------------------------------------------------------


def test_a_well_formed_request_with_tools_is_accepted() -> None:
    optional = {
        "type": "object",
        "properties": {
            "unit": {"enum": ["m", "ft"]},
            "n": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "xs": {"type": "array", "items": {"type": "number"}},
        },
    }
    request = parsed_request(
        _body(tools=[_tool(CALCULATE), _tool(optional, "convert"), _tool(None, "now")])
    )
    assert [t.function.name for t in request.tools] == ["calculate", "convert", "now"]


@pytest.mark.parametrize(
    ("parameters", "field"),
    [
        ({"properties": ["expression"]}, "parameters.properties must be an object of schemas"),
        ({"properties": "expression"}, "parameters.properties must be an object of schemas"),
        ({"properties": {"x": "string"}}, "parameters.properties.x must be a schema"),
        ({"properties": {"x": {"enum": 5}}}, "parameters.properties.x.enum must be a list"),
        ({"properties": {"x": {"enum": {"a": 1}}}}, "parameters.properties.x.enum must be a list"),
        ({"properties": {"x": {}}, "required": 5}, "parameters.required must be a list"),
        ({"properties": {"x": {}}, "required": [1]}, "parameters.required must be a list"),
        ({"properties": {"x": {}}, "required": ["y"]}, 'parameters.required names "y"'),
        ({"properties": {"x": {"type": 5}}}, "parameters.properties.x.type must be a type name"),
        ({"properties": {"x": {"description": []}}}, "properties.x.description must be text"),
        ({"properties": {"x": {"anyOf": {"type": "string"}}}}, "properties.x.anyOf must be a list"),
        ({"properties": {"x": {"anyOf": [5]}}}, "properties.x.anyOf[0] must be a schema"),
        ({"properties": {"x": {"items": [1]}}}, "properties.x.items[0] must be a schema"),
        ({"properties": {}, "examples": {"x": 1}}, "parameters.examples must be a list"),
        (
            {"properties": {"x": {"properties": {"y": {"enum": 1}}}}},
            "properties.x.properties.y.enum must be a list",
        ),
    ],
)
def test_a_tool_schema_the_formats_cannot_read_is_refused_naming_tool_and_field(
    parameters, field
) -> None:
    with pytest.raises(ValueError, match="tools") as refused:
        parsed_request(_body(tools=[_tool(CALCULATE, "ok"), _tool(parameters)]))
    assert str(refused.value).startswith("tools[1] (calculate): parameters")
    assert field in str(refused.value)


def test_a_tool_without_a_name_is_refused() -> None:
    with pytest.raises(ValueError, match=r"tools\[0\] \(\): name is empty"):
        parsed_request(_body(tools=[{"type": "function", "function": {"name": ""}}]))


@pytest.mark.parametrize("depth", [MAX_REQUEST_DEPTH + 1, 5000, 200_000])
def test_a_body_nested_too_deep_is_refused(depth) -> None:
    body = _body(tools=[_tool({"properties": {"x": {"default": "NESTED"}}})])
    body = body.replace(b'"NESTED"', _nested(depth).encode())
    with pytest.raises(ValueError, match=f"the request body nests more than {MAX_REQUEST_DEPTH}"):
        parsed_request(body)


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 990, 5000, 200_000])
def test_tool_call_arguments_nested_too_deep_are_refused(depth) -> None:
    body = _body(
        messages=[
            USER,
            _call(_nested(depth)),
            {"role": "tool", "tool_call_id": "c1", "content": "5"},
        ]
    )
    with pytest.raises(ValueError, match="arguments nests") as refused:
        parsed_request(body)
    assert str(refused.value) == (
        f"messages[1].tool_calls[0].function.arguments nests more than {MAX_JSON_DEPTH} levels "
        "deep; write it flatter"
    )


def test_tool_call_arguments_as_deep_as_the_formats_read_are_accepted() -> None:
    request = parsed_request(_body(messages=[USER, _call(_nested(MAX_JSON_DEPTH))]))
    assert len(request.messages) == 2


def test_too_many_messages_are_refused_before_they_are_validated() -> None:
    body = _body(messages=[USER] * (MAX_REQUEST_MESSAGES + 1))
    with pytest.raises(ValueError, match=f"at most {MAX_REQUEST_MESSAGES}"):
        parsed_request(body)


# -- refused by AgentChat before anything could fail ---------------------------------------------


def test_a_templates_raise_exception_is_refused_with_its_message() -> None:
    raising = AutoTokenizer.from_pretrained(resolve_model_path("tiny-qwen2"))
    raising.chat_template = QWEN25_TEMPLATE.replace(
        "{%- if tools %}",
        "{%- if messages[-1].content == 'twice' %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}{%- endif %}\n"
        "{%- if tools %}",
        1,
    )
    chat = AgentChat(ChatRenderer(raising), GeneratorConfig(), EnvConfig(), "hermes", 8192, "m")
    episode = AgentEpisode("t")
    request = parsed_request(_body(messages=[USER, {"role": "user", "content": "twice"}]))
    with pytest.raises(RequestRefusedError) as refused:
        chat.prompt(episode, request)
    assert str(refused.value) == (
        "the model's chat template refused this conversation: Conversation roles must "
        "alternate user/assistant"
    )
    assert refused.value.status == 400
    assert refused.value.code is None  # the agent may send another conversation
    assert episode.segments == []
    assert episode.finish_reason is None
    assert episode.requests == 0
    ids, _ = chat.prompt(episode, parsed_request(_body()))
    assert ids == chat.renderer.prompt_ids([USER])


def test_a_message_too_long_for_the_budget_is_refused_before_it_is_tokenised(
    tagged_tokenizer, monkeypatch
) -> None:
    """A 2 MiB message against a 256-token budget: refused by its size alone, the episode
    ended as a too-long request ends it, nothing templated or tokenised."""
    chat = _chat(tagged_tokenizer, max_episode_tokens=256)
    rendered: list[Any] = []
    monkeypatch.setattr(chat.renderer, "encode", lambda text: rendered.append(text))
    monkeypatch.setattr(chat.renderer, "_render", lambda *a, **k: rendered.append(a))
    episode = AgentEpisode("t")
    request = parsed_request(_body(messages=[{"role": "user", "content": "hello world " * 2**18}]))
    with pytest.raises(RequestRefusedError) as refused:
        chat.prompt(episode, request)
    assert str(refused.value).startswith(
        f"the messages hold {12 * 2**18} characters: more than the 256 tokens of this "
        "episode's budget (generator.env.max_episode_tokens) can hold at "
        f"{chat.chars_per_token} characters a token"
    )
    assert refused.value.code == EPISODE_ENDED
    assert episode.finish_reason == "max_tokens"
    assert rendered == []


def test_a_conversation_within_the_character_bound_is_still_measured_in_tokens(
    tagged_tokenizer,
) -> None:
    chat = _chat(tagged_tokenizer, max_episode_tokens=64)
    content = "a" * (64 * chat.chars_per_token - 100)  # below the bound, far over in tokens
    with pytest.raises(RequestRefusedError, match="the conversation would be"):
        chat.prompt(
            AgentEpisode("t"),
            parsed_request(_body(messages=[{"role": "user", "content": content}])),
        )


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(text=st.text(min_size=1, max_size=400))
def test_no_text_takes_fewer_tokens_than_the_character_bound_says(tagged_tokenizer, text) -> None:
    """The bound the size refusal rests on: no text is spelt by fewer tokens than its
    characters divided by `most_chars_per_token` (normalisation, merges, special tokens)."""
    ids = tagged_tokenizer.encode(text, add_special_tokens=False)
    assert len(text) <= len(ids) * most_chars_per_token(tagged_tokenizer)


# -- the policy's own calls, echoed back -----------------------------------------------------------


def _sampled(tokenizer: Any, text: str) -> Completion:
    ids = [
        *tokenizer.encode(text, add_special_tokens=False),
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
    ]
    n = len(ids)
    return Completion(
        np.asarray(ids, np.int32), np.full(n, -0.5, np.float32), text, "stop", np.zeros(n, np.int64)
    )


def test_a_policys_call_nested_too_deep_stays_text_so_its_echo_is_not_refused(
    hermes_tokenizer,
) -> None:
    """vLLM's hermes parser reads JSON a few hundred levels deep; the endpoint returns only
    the calls the tool formats read (`MAX_JSON_DEPTH`), so an agent echoing its answer back
    sends nothing the endpoint refuses."""
    chat = _chat(hermes_tokenizer, "hermes")
    episode = AgentEpisode("t")
    request = parsed_request(_body(tools=[_tool(CALCULATE)]))
    chat.prompt(episode, request)
    deep = '{"expression": ' + _nested(MAX_JSON_DEPTH + 5) + "}"
    text = '<tool_call>\n{"name": "calculate", "arguments": ' + deep + "}\n</tool_call>"
    body = chat.reply(episode, request, _sampled(hermes_tokenizer, text))
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": text}
    echoed = parsed_request(
        _body(
            messages=[USER, message, {"role": "user", "content": "go on"}], tools=[_tool(CALCULATE)]
        )
    )
    chat.prompt(episode, echoed)
    assert len(episode.segments) == 1
