"""AgentChat without vLLM's engine: an agent's chat-completions requests rendered into its
episode's exact token history — the first request as a tool environment's first prompt, a
request repeating the history extending the same segment (sampled tokens kept as sampled), an
edited history starting a new segment — tool calls read from sampled text, requests asking for
other sampling refused, and the episode's budgets (max_turns, max_episode_tokens, a truncated
turn) ending it. Sampled turns are faked as `Completion`s of the tiny model's tokenizer."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from streamrl.envs.agent import EPISODE_ENDED
from streamrl.envs.chat import ChatRenderer
from streamrl.envs.config import EnvConfig
from streamrl.envs.conversations import tools_from_schemas
from streamrl.envs.formats import TaggedFormat
from streamrl.generator.agent_chat import AgentChat, AgentEpisode
from streamrl.generator.agent_messages import RequestRefusedError
from streamrl.generator.config import GeneratorConfig
from streamrl.generator.engine import Completion
from streamrl.generator.transcript import Transcript

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "The expression."}},
                "required": ["expression"],
            },
        },
    }
]
USER = {"role": "user", "content": "What is 2+3?"}
HERMES_CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2+3"}}\n</tool_call>'
TAGGED_CALL = '<tool>calculate(expression="2+3")</tool>'


def _chat(
    tokenizer: Any,
    tool_format: str,
    max_episode_tokens: int = 8192,
    generator: GeneratorConfig | None = None,
    **env: Any,
) -> AgentChat:
    renderer = ChatRenderer(tokenizer)
    generator = generator or GeneratorConfig()
    return AgentChat(renderer, generator, EnvConfig(**env), tool_format, max_episode_tokens, "m")


def _request(messages: list[dict[str, Any]], **fields: Any) -> Any:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **fields})


def _completion(
    tokenizer: Any, text: str, finish_reason: str = "stop", version: int = 3
) -> Completion:
    """A sampled turn: `text`'s ids, then the template's end-of-turn token unless truncated."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if finish_reason == "stop":
        ids.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    n = len(ids)
    return Completion(
        token_ids=np.asarray(ids, np.int32),
        logprobs=np.linspace(-0.1, -2.0, n).astype(np.float32),
        text=text,
        finish_reason=finish_reason,
        versions=np.full(n, version, np.int64),
    )


def _snapshot(episode: AgentEpisode) -> tuple[Any, ...]:
    return (
        [s.token_ids() for s in episode.segments],
        list(episode.seen),
        episode.requests,
        episode.finish_reason,
        episode.tools_key,
    )


# -- the first request -------------------------------------------------------------------------


def test_first_request_without_tools_is_the_templated_prompt(tagged_tokenizer) -> None:
    chat = _chat(tagged_tokenizer, "tagged")
    episode = AgentEpisode("t")
    messages = [{"role": "system", "content": "Be brief."}, USER]
    ids, budget = chat.prompt(episode, _request(messages))
    assert ids == chat.renderer.prompt_ids(messages)
    assert budget == GeneratorConfig().max_tokens
    assert len(episode.segments) == 1
    assert episode.requests == 1
    assert episode.segments[0].sampled == 0
    assert episode.segments[0].length == len(ids)


def test_first_request_with_tools_in_hermes_gives_them_to_the_template(hermes_tokenizer) -> None:
    chat = _chat(hermes_tokenizer, "hermes")
    episode = AgentEpisode("t")
    ids, _ = chat.prompt(episode, _request([USER], tools=TOOLS))
    assert ids == chat.renderer.prompt_ids([USER], TOOLS)
    assert ids != chat.renderer.prompt_ids([USER])
    assert '"name": "calculate"' in hermes_tokenizer.decode(ids)
    assert episode.tools_offered


def test_first_request_with_tools_in_tagged_describes_them_in_the_system_prompt(
    tagged_tokenizer,
) -> None:
    chat = _chat(tagged_tokenizer, "tagged")
    episode = AgentEpisode("t")
    ids, _ = chat.prompt(episode, _request([USER], tools=TOOLS))
    described = TaggedFormat().prompt([USER], tools_from_schemas(TOOLS))
    assert described[0]["role"] == "system"
    assert "calculate(" in described[0]["content"]
    assert ids == chat.renderer.prompt_ids(described)
    text = tagged_tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nYou can use tools")
    assert "Evaluate an arithmetic expression." in text


def test_max_tokens_only_lowers_the_turn_budget(tagged_tokenizer) -> None:
    chat = _chat(tagged_tokenizer, "tagged", turn_max_tokens=100)
    _, budget = chat.prompt(AgentEpisode("a"), _request([USER], max_tokens=7))
    assert budget == 7
    _, budget = chat.prompt(AgentEpisode("b"), _request([USER], max_completion_tokens=5000))
    assert budget == 100


def test_budget_is_cut_to_what_is_left_of_the_episode(tagged_tokenizer) -> None:
    chat = _chat(tagged_tokenizer, "tagged")
    prompt_length = len(chat.renderer.prompt_ids([USER]))
    chat = _chat(tagged_tokenizer, "tagged", max_episode_tokens=prompt_length + 3)
    _, budget = chat.prompt(AgentEpisode("a"), _request([USER]))
    assert budget == 3


# -- continuing the history --------------------------------------------------------------------


def test_a_request_repeating_the_history_extends_the_same_segment(tagged_tokenizer) -> None:
    chat = _chat(tagged_tokenizer, "tagged")
    episode = AgentEpisode("t")
    first = _request([USER])
    prompt, _ = chat.prompt(episode, first)
    sampled = _completion(tagged_tokenizer, "It is 5.")
    body = chat.reply(episode, first, sampled)
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "It is 5."}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(sampled.token_ids),
        "total_tokens": len(prompt) + len(sampled.token_ids),
    }

    follow_up = {"role": "user", "content": "And 2*3?"}
    ids, _ = chat.prompt(episode, _request([USER, message, follow_up]))
    history = prompt + sampled.token_ids.tolist()
    assert ids[: len(history)] == history  # the sampled tokens as sampled
    added = chat.renderer.observation_ids([follow_up], ended_with_eos=True)
    assert ids[len(history) :] == added
    assert len(episode.segments) == 1
    assert episode.requests == 2

    tokens, logprobs, mask, versions = episode.segments[0].arrays()
    assert tokens.tolist() == ids
    n = len(sampled.token_ids)
    expected_mask = [0] * len(prompt) + [1] * n + [0] * len(added)
    assert mask.tolist() == expected_mask
    np.testing.assert_array_equal(logprobs[len(prompt) : len(prompt) + n], sampled.logprobs)
    assert not logprobs[mask == 0].any()
    assert versions[len(prompt) : len(prompt) + n].tolist() == [3] * n
    assert episode.segments[0].sampled == n
    assert episode.segments[0].turns == 1


@pytest.mark.parametrize("tool_format", ["hermes", "tagged"])
def test_a_tool_result_extends_the_segment_as_the_formats_observation(
    tool_format, hermes_tokenizer, tagged_tokenizer
) -> None:
    tokenizer = hermes_tokenizer if tool_format == "hermes" else tagged_tokenizer
    chat = _chat(tokenizer, tool_format)
    episode = AgentEpisode("t")
    first = _request([USER], tools=TOOLS)
    prompt, _ = chat.prompt(episode, first)
    text = HERMES_CALL if tool_format == "hermes" else TAGGED_CALL
    sampled = _completion(tokenizer, text)
    body = chat.reply(episode, first, sampled)
    message = body["choices"][0]["message"]
    call = message["tool_calls"][0]
    result = {"role": "tool", "tool_call_id": call["id"], "content": "5"}
    ids, _ = chat.prompt(episode, _request([USER, message, result], tools=TOOLS))

    history = prompt + sampled.token_ids.tolist()
    assert ids[: len(history)] == history
    if tool_format == "hermes":
        observation = [{"role": "tool", "name": "calculate", "content": "5"}]
    else:  # a template without tools: one user message of <tool_result> blocks
        observation = [
            {"role": "user", "content": '<tool_result name="calculate">\n5\n</tool_result>'}
        ]
    assert ids[len(history) :] == chat.renderer.observation_ids(observation, ended_with_eos=True)
    assert len(episode.segments) == 1
    assert episode.segment_tool_calls == [1]
    mask = episode.segments[0].arrays()[2]
    assert mask.sum() == len(sampled.token_ids)
    assert mask[len(prompt) : len(history)].all()


def test_a_turn_stopped_by_a_stop_string_is_followed_by_the_whole_closing(
    tagged_tokenizer,
) -> None:
    chat = _chat(tagged_tokenizer, "tagged")
    episode = AgentEpisode("t")
    first = _request([USER])
    prompt, _ = chat.prompt(episode, first)
    sampled = _completion(tagged_tokenizer, "It is 5.", finish_reason="stop")
    sampled = Completion(  # no end-of-turn token: a stop string ended it
        sampled.token_ids[:-1], sampled.logprobs[:-1], sampled.text, "stop", sampled.versions[:-1]
    )
    message = chat.reply(episode, first, sampled)["choices"][0]["message"]
    assert not episode.last_eos
    assert episode.finish_reason is None
    follow_up = {"role": "user", "content": "Sure?"}
    ids, _ = chat.prompt(episode, _request([USER, message, follow_up]))
    history = prompt + sampled.token_ids.tolist()
    added = chat.renderer.observation_ids([follow_up], ended_with_eos=False)
    assert ids == history + added
    assert tagged_tokenizer.decode(added).startswith("<|im_end|>")


def test_a_long_tool_result_is_cut_to_the_observation_limits(tagged_tokenizer) -> None:
    chat = _chat(tagged_tokenizer, "tagged", observation_max_chars=200, observation_max_tokens=40)
    episode = AgentEpisode("t")
    first = _request([USER], tools=TOOLS)
    prompt, _ = chat.prompt(episode, first)
    sampled = _completion(tagged_tokenizer, TAGGED_CALL)
    message = chat.reply(episode, first, sampled)["choices"][0]["message"]
    result = {
        "role": "tool",
        "tool_call_id": message["tool_calls"][0]["id"],
        "content": "digits " * 2000,
    }
    ids, _ = chat.prompt(episode, _request([USER, message, result], tools=TOOLS))
    added = ids[len(prompt) + len(sampled.token_ids) :]
    assert 0 < len(added) <= 40
    assert tagged_tokenizer.decode(added).endswith("<|im_start|>assistant\n")
    assert len(episode.segments) == 1
    assert episode.finish_reason is None


# -- tool calls ---------------------------------------------------------------------------------


def test_hermes_tool_call_comes_back_as_tool_calls(hermes_tokenizer) -> None:
    chat = _chat(hermes_tokenizer, "hermes")
    episode = AgentEpisode("t")
    request = _request([USER], tools=TOOLS)
    chat.prompt(episode, request)
    body = chat.reply(episode, request, _completion(hermes_tokenizer, HERMES_CALL))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] in (None, "")
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function"
    assert call["id"]
    assert call["function"]["name"] == "calculate"
    assert json.loads(call["function"]["arguments"]) == {"expression": "2+3"}


def test_hermes_call_echoed_with_reserialised_arguments_still_extends(hermes_tokenizer) -> None:
    chat = _chat(hermes_tokenizer, "hermes")
    episode = AgentEpisode("t")
    first = _request([USER], tools=TOOLS)
    prompt, _ = chat.prompt(episode, first)
    sampled = _completion(hermes_tokenizer, HERMES_CALL)
    message = chat.reply(episode, first, sampled)["choices"][0]["message"]
    call = message["tool_calls"][0]
    echoed = {  # as a client would write it back: compact JSON, content omitted
        "role": "assistant",
        "tool_calls": [
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": "calculate", "arguments": '{"expression":"2+3"}'},
            }
        ],
    }
    result = {"role": "tool", "tool_call_id": call["id"], "content": "5"}
    ids, _ = chat.prompt(episode, _request([USER, echoed, result], tools=TOOLS))
    assert len(episode.segments) == 1  # no split
    history = prompt + sampled.token_ids.tolist()
    assert ids[: len(history)] == history
    assert "<tool_response>\n5\n</tool_response>" in hermes_tokenizer.decode(ids[len(history) :])


def test_hermes_text_around_a_call_and_plain_text(hermes_tokenizer) -> None:
    chat = _chat(hermes_tokenizer, "hermes")
    episode = AgentEpisode("t")
    request = _request([USER], tools=TOOLS)
    prompt, _ = chat.prompt(episode, request)
    text = "Let me compute.\n" + HERMES_CALL
    sampled = _completion(hermes_tokenizer, text)
    body = chat.reply(episode, request, sampled)
    message = body["choices"][0]["message"]
    assert message["content"].strip() == "Let me compute."
    assert message["tool_calls"][0]["function"]["name"] == "calculate"
    result = {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "5"}
    ids, _ = chat.prompt(episode, _request([USER, message, result], tools=TOOLS))
    assert len(episode.segments) == 1
    assert ids[: len(prompt) + len(sampled.token_ids)] == prompt + sampled.token_ids.tolist()

    body = chat.reply(episode, request, _completion(hermes_tokenizer, "It is 5."))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "It is 5."}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert episode.segment_tool_calls == [1]


def test_tagged_tool_call_comes_back_as_tool_calls(tagged_tokenizer) -> None:
    chat = _chat(tagged_tokenizer, "tagged")
    episode = AgentEpisode("t")
    request = _request([USER], tools=TOOLS)
    chat.prompt(episode, request)
    text = "Let me compute. " + TAGGED_CALL
    body = chat.reply(episode, request, _completion(tagged_tokenizer, text))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me compute."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "calculate"
    assert json.loads(call["function"]["arguments"]) == {"expression": "2+3"}
    assert episode.segment_tool_calls == [1]


def test_tagged_positional_argument_is_named_from_the_schema(tagged_tokenizer) -> None:
    chat = _chat(tagged_tokenizer, "tagged")
    episode = AgentEpisode("t")
    request = _request([USER], tools=TOOLS)
    chat.prompt(episode, request)
    text = '<tool>calculate("7*6")</tool>'
    body = chat.reply(episode, request, _completion(tagged_tokenizer, text))
    (call,) = body["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"expression": "7*6"}


def test_calls_are_not_read_without_tools_nor_of_unknown_tools(tagged_tokenizer) -> None:
    chat = _chat(tagged_tokenizer, "tagged")
    episode = AgentEpisode("a")
    request = _request([USER])  # no tools offered: the text is the answer
    chat.prompt(episode, request)
    body = chat.reply(episode, request, _completion(tagged_tokenizer, TAGGED_CALL))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": TAGGED_CALL}
    assert body["choices"][0]["finish_reason"] == "stop"

    episode = AgentEpisode("b")
    request = _request([USER], tools=TOOLS)
    chat.prompt(episode, request)
    text = '<tool>search(query="x")</tool>'
    body = chat.reply(episode, request, _completion(tagged_tokenizer, text))
    assert "tool_calls" not in body["choices"][0]["message"]
    assert body["choices"][0]["message"]["content"] == text


def test_tool_choice_none_hides_the_tools(hermes_tokenizer) -> None:
    chat = _chat(hermes_tokenizer, "hermes")
    episode = AgentEpisode("t")
    request = _request([USER], tools=TOOLS, tool_choice="none")
    ids, _ = chat.prompt(episode, request)
    assert ids == chat.renderer.prompt_ids([USER])
    body = chat.reply(episode, request, _completion(hermes_tokenizer, HERMES_CALL))
    assert "tool_calls" not in body["choices"][0]["message"]
    assert not episode.tools_offered


# -- divergence --------------------------------------------------------------------------------


def test_an_edited_history_starts_a_new_segment(tagged_tokenizer) -> None:
    chat = _chat(tagged_tokenizer, "tagged")
    episode = AgentEpisode("t")
    first = _request([USER])
    prompt, _ = chat.prompt(episode, first)
    sampled = _completion(tagged_tokenizer, "It is 5.")
    message = chat.reply(episode, first, sampled)["choices"][0]["message"]

    edited = {"role": "user", "content": "What is 2+4?"}
    follow_up = {"role": "user", "content": "Sure?"}
    ids, _ = chat.prompt(episode, _request([edited, message, follow_up]))
    assert len(episode.segments) == 2
    assert ids == chat.renderer.prompt_ids([edited, message, follow_up])
    second = episode.segments[1]
    assert len(second.chunks) == 1
    assert second.chunks[0][0].tolist() == ids
    assert second.sampled == 0
    assert not second.arrays()[2].any()

    kept = episode.segments[0]
    assert kept.turns == 1
    assert kept.token_ids() == prompt + sampled.token_ids.tolist()
    assert kept.arrays()[2].sum() == len(sampled.token_ids)
    assert episode.segment_tool_calls == [0, 0]

    # The new segment goes on from its own history.
    again = _completion(tagged_tokenizer, "Yes, 6.")
    answer = chat.reply(episode, _request([edited, message, follow_up]), again)
    later = {"role": "user", "content": "Thanks."}
    more, _ = chat.prompt(
        episode, _request([edited, message, follow_up, answer["choices"][0]["message"], later])
    )
    assert len(episode.segments) == 2
    assert more[: len(ids) + len(again.token_ids)] == ids + again.token_ids.tolist()


def test_changed_tools_start_a_new_segment(tagged_tokenizer) -> None:
    chat = _chat(tagged_tokenizer, "tagged")
    episode = AgentEpisode("t")
    first = _request([USER], tools=TOOLS)
    chat.prompt(episode, first)
    message = chat.reply(episode, first, _completion(tagged_tokenizer, "5"))["choices"][0][
        "message"
    ]
    follow_up = {"role": "user", "content": "Again."}
    chat.prompt(episode, _request([USER, message, follow_up]))  # tools dropped
    assert len(episode.segments) == 2


# -- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 0.7},
        {"top_p": 0.9},
        {"n": 2},
        {"stream": True},
        {"tool_choice": "required", "tools": TOOLS},
        {"logprobs": True, "top_logprobs": 3},
        {"logit_bias": {"5": 1.0}},
        {"stop": ["\n"]},
        {"presence_penalty": 0.5},
        {"tool_choice": {"type": "function", "function": {"name": "calculate"}}, "tools": TOOLS},
        {"response_format": {"type": "json_object"}},
    ],
    ids=lambda f: next(k for k in f if k not in ("tools", "logprobs")),
)
def test_requests_for_other_sampling_are_refused(tagged_tokenizer, fields) -> None:
    chat = _chat(tagged_tokenizer, "tagged")
    episode = AgentEpisode("t")
    first = _request([USER])
    chat.prompt(episode, first)
    message = chat.reply(episode, first, _completion(tagged_tokenizer, "5"))["choices"][0][
        "message"
    ]
    before = _snapshot(episode)
    follow_up = {"role": "user", "content": "More?"}
    with pytest.raises(RequestRefusedError) as refused:
        chat.prompt(episode, _request([USER, message, follow_up], **fields))
    name = next(k for k in fields if k not in ("tools", "logprobs"))
    assert name in str(refused.value)
    assert refused.value.status == 400
    assert refused.value.code is None
    assert _snapshot(episode) == before
    assert episode.finish_reason is None


def test_the_runs_own_sampling_is_accepted(tagged_tokenizer) -> None:
    generator = GeneratorConfig(temperature=0.7)
    chat = _chat(tagged_tokenizer, "tagged", generator=generator)
    fields = {"temperature": 0.7, "top_p": 1.0, "n": 1, "stream": False, "logprobs": True,
              "top_logprobs": 0, "tool_choice": "auto", "tools": TOOLS, "seed": 5,
              "max_tokens": 9, "stop": []}  # fmt: skip
    ids, budget = chat.prompt(AgentEpisode("t"), _request([USER], **fields))
    assert ids
    assert budget == 9
    with pytest.raises(RequestRefusedError, match="temperature"):
        chat.prompt(AgentEpisode("u"), _request([USER], temperature=1.0))


@pytest.mark.parametrize("name", ["frequency_penalty", "presence_penalty"])
def test_neutral_penalties_are_accepted(tagged_tokenizer, name) -> None:
    chat = _chat(tagged_tokenizer, "tagged")
    ids, _ = chat.prompt(AgentEpisode("t"), _request([USER], **{name: 0.0}))
    assert ids == chat.renderer.prompt_ids([USER])


def test_logprobs_are_the_sampled_tokens_own(tagged_tokenizer) -> None:
    chat = _chat(tagged_tokenizer, "tagged")
    episode = AgentEpisode("t")
    request = _request([USER], logprobs=True)
    chat.prompt(episode, request)
    sampled = _completion(tagged_tokenizer, "It is 5.")
    content = chat.reply(episode, request, sampled)["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == pytest.approx(sampled.logprobs.tolist())
    assert "".join(c["token"] for c in content) == "It is 5.<|im_end|>"


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"role": "function", "content": "x"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    ],
    ids=["empty", "function-role", "image"],
)
def test_unserved_messages_are_refused(tagged_tokenizer, messages) -> None:
    chat = _chat(tagged_tokenizer, "tagged")
    episode = AgentEpisode("t")
    with pytest.raises(RequestRefusedError):
        chat.prompt(episode, _request(messages))
    assert episode.segments == []
    assert episode.requests == 0


def test_text_parts_and_developer_messages_are_read_as_text_and_system(tagged_tokenizer) -> None:
    chat = _chat(tagged_tokenizer, "tagged")
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+3?"}]
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": parts}]
    ids, _ = chat.prompt(AgentEpisode("t"), _request(messages))
    plain = [{"role": "system", "content": "Be brief."}, USER]
    assert ids == chat.renderer.prompt_ids(plain)


def _take_turns(chat: AgentChat, tokenizer: Any, episode: AgentEpisode, turns: int) -> list:
    messages: list[dict[str, Any]] = [USER]
    for k in range(turns):
        request = _request(messages)
        chat.prompt(episode, request)
        body = chat.reply(episode, request, _completion(tokenizer, f"Answer {k}."))
        messages = [*messages, body["choices"][0]["message"], {"role": "user", "content": "?"}]
    return messages


def test_max_turns_refuses_the_next_request_and_ends_the_episode(tagged_tokenizer) -> None:
    chat = _chat(tagged_tokenizer, "tagged", max_turns=2)
    episode = AgentEpisode("t")
    messages = _take_turns(chat, tagged_tokenizer, episode, 2)
    segments = [s.token_ids() for s in episode.segments]
    with pytest.raises(RequestRefusedError, match="max_turns"):
        chat.prompt(episode, _request(messages))
    assert episode.finish_reason == "max_turns"
    assert episode.requests == 2
    assert [s.token_ids() for s in episode.segments] == segments
    with pytest.raises(RequestRefusedError, match="ended"):  # and every request after it
        chat.prompt(episode, _request(messages))


def test_max_turns_refusal_carries_the_episode_ended_code(tagged_tokenizer) -> None:
    chat = _chat(tagged_tokenizer, "tagged", max_turns=1)
    episode = AgentEpisode("t")
    messages = _take_turns(chat, tagged_tokenizer, episode, 1)
    with pytest.raises(RequestRefusedError) as refused:
        chat.prompt(episode, _request(messages))
    assert episode.finish_reason == "max_turns"
    assert refused.value.code == EPISODE_ENDED


def test_a_first_request_longer_than_the_episode_budget_is_refused(tagged_tokenizer) -> None:
    chat = _chat(tagged_tokenizer, "tagged", max_episode_tokens=20)
    episode = AgentEpisode("t")
    long = {"role": "user", "content": "word " * 50}
    with pytest.raises(RequestRefusedError, match="max_episode_tokens") as refused:
        chat.prompt(episode, _request([long]))
    assert refused.value.code == EPISODE_ENDED
    assert episode.finish_reason == "max_tokens"
    assert episode.segments == []
    assert episode.requests == 0


def test_an_observation_past_the_episode_budget_ends_it(tagged_tokenizer) -> None:
    chat = _chat(tagged_tokenizer, "tagged")
    budget = len(chat.renderer.prompt_ids([USER])) + 30
    chat = _chat(tagged_tokenizer, "tagged", max_episode_tokens=budget)
    episode = AgentEpisode("t")
    first = _request([USER])
    chat.prompt(episode, first)
    message = chat.reply(episode, first, _completion(tagged_tokenizer, "It is 5."))["choices"][0][
        "message"
    ]
    length = episode.segments[0].length
    long = {"role": "user", "content": "word " * 100}
    with pytest.raises(RequestRefusedError) as refused:
        chat.prompt(episode, _request([USER, message, long]))
    assert refused.value.code == EPISODE_ENDED
    assert episode.finish_reason == "max_tokens"
    assert episode.segments[0].length == length
    assert episode.requests == 1


def test_a_truncated_turn_ends_the_episode(tagged_tokenizer) -> None:
    chat = _chat(tagged_tokenizer, "tagged")
    episode = AgentEpisode("t")
    first = _request([USER])
    chat.prompt(episode, first)
    cut = _completion(tagged_tokenizer, "It is five and", finish_reason="length")
    body = chat.reply(episode, first, cut)
    assert body["choices"][0]["finish_reason"] == "length"
    assert episode.finish_reason == "max_tokens"
    assert not episode.last_eos
    message = body["choices"][0]["message"]
    with pytest.raises(RequestRefusedError, match="ended"):
        chat.prompt(episode, _request([USER, message, {"role": "user", "content": "Go on."}]))
    assert episode.requests == 1
    assert len(episode.segments) == 1


def test_the_refusal_after_a_truncated_turn_carries_the_episode_ended_code(
    tagged_tokenizer,
) -> None:
    chat = _chat(tagged_tokenizer, "tagged")
    episode = AgentEpisode("t")
    first = _request([USER])
    chat.prompt(episode, first)
    cut = _completion(tagged_tokenizer, "It is five and", finish_reason="length")
    message = chat.reply(episode, first, cut)["choices"][0]["message"]
    with pytest.raises(RequestRefusedError) as refused:
        chat.prompt(episode, _request([USER, message, {"role": "user", "content": "Go on."}]))
    assert refused.value.code == EPISODE_ENDED


# -- Transcript.without_prefix -------------------------------------------------------------------


def _transcript(tokenizer: Any) -> tuple[Transcript, Completion]:
    transcript = Transcript()
    transcript.add_observation([1, 2, 3, 4])
    sampled = _completion(tokenizer, "It is 5.", version=7)
    transcript.add_turn(sampled)
    transcript.add_observation([5, 6])
    return transcript, sampled


def test_without_prefix_cuts_environment_tokens(tagged_tokenizer) -> None:
    transcript, sampled = _transcript(tagged_tokenizer)
    n = len(sampled.token_ids)
    for cut in (0, 2, 4):
        rest = transcript.without_prefix(cut)
        tokens, logprobs, mask, versions = rest.arrays()
        full = transcript.arrays()
        for part, whole in zip((tokens, logprobs, mask, versions), full, strict=True):
            np.testing.assert_array_equal(part, whole[cut:])
        assert rest.length == transcript.length - cut == len(tokens)
        assert rest.sampled == n
        assert rest.turns == 1
    assert transcript.without_prefix(4).chunks[0][0].tolist() == sampled.token_ids.tolist()
    assert transcript.length == 4 + n + 2  # the original is unchanged


def test_without_prefix_refuses_to_cut_sampled_tokens(tagged_tokenizer) -> None:
    transcript, sampled = _transcript(tagged_tokenizer)
    with pytest.raises(ValueError, match="environment tokens"):
        transcript.without_prefix(5)
    with pytest.raises(ValueError, match="environment tokens"):
        transcript.without_prefix(4 + len(sampled.token_ids) + 1)
