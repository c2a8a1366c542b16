"""Conversations as SFT tokens (`streamrl.envs.conversations`): the ids are the chat template's
own rendering of the conversation (checked against the template applied to the whole
conversation, with Qwen2.5's tool template and with the demo model's), the loss mask covers
exactly the assistant's turns and their end-of-turn tokens, the calls are written as the
environment's tool format parses them, and a broken conversation is refused naming the message."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from streamrl.envs import TOOL_FORMATS, tool
from streamrl.envs.calculator import calculate
from streamrl.envs.conversations import ConversationError, ConversationRenderer, tools_from_schemas
from streamrl.models import resolve_model_path

QWEN25_TEMPLATE = (Path(__file__).parents[2] / "qwen25_chat_template.jinja").read_text()
CALL = {"type": "function", "function": {"name": "calculate",
                                         "arguments": {"expression": "(3 + 4) * 5"}}}  # fmt: skip
CONVERSATION = [
    {"role": "user", "content": "What is (3 + 4) * 5?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "name": "calculate", "content": "35"},
    {"role": "assistant", "content": "The answer is \\boxed{35}."},
]


@pytest.fixture(scope="module")
def qwen_tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny-qwen2"))
    tokenizer.chat_template = QWEN25_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def smollm_tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))


def _masked_runs(tokenizer, rendered) -> list[str]:
    """The decoded text of each run of loss-mask-1 tokens."""
    runs, current = [], []
    for token, on in zip(rendered.token_ids, rendered.loss_mask, strict=True):
        if on:
            current.append(int(token))
        elif current:
            runs, current = [*runs, tokenizer.decode(current)], []
    return runs + ([tokenizer.decode(current)] if current else [])


def test_hermes_ids_are_the_templates_own_rendering_and_the_mask_the_assistants_turns(
    qwen_tokenizer,
) -> None:
    renderer = ConversationRenderer(qwen_tokenizer, "hermes")
    tools = [tool(calculate)]
    rendered = renderer.render(CONVERSATION, tools)
    # The reference: the template applied to the whole conversation, its calls rendered by the
    # template itself (tools= given), up to the last end-of-turn token.
    reference = qwen_tokenizer.apply_chat_template(
        CONVERSATION, tools=[t.schema for t in tools], tokenize=False
    )
    assert reference.endswith("<|im_end|>\n")
    assert qwen_tokenizer.decode(rendered.token_ids) == reference[: -len("\n")]
    assert rendered.token_ids.tolist() == qwen_tokenizer.encode(reference[:-1])
    call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "(3 + 4) * 5"}}\n'
    assert _masked_runs(qwen_tokenizer, rendered) == [
        f"{call}</tool_call><|im_end|>",
        "The answer is \\boxed{35}.<|im_end|>",
    ]
    first = int(np.flatnonzero(rendered.loss_mask)[0])
    assert rendered.prompt_length == first
    assert qwen_tokenizer.decode(rendered.token_ids[:first]).endswith("<|im_start|>assistant\n")
    # What the model learns to write is what the environment parses.
    (parsed,) = TOOL_FORMATS["hermes"].parse(_masked_runs(qwen_tokenizer, rendered)[0])
    assert (parsed.name, parsed.arguments) == ("calculate", {"expression": "(3 + 4) * 5"})


def test_tagged_calls_and_results_are_written_as_the_environment_writes_them(
    smollm_tokenizer,
) -> None:
    renderer = ConversationRenderer(smollm_tokenizer, "tagged")
    tagged = TOOL_FORMATS["tagged"]
    tools = [tool(calculate, example={"expression": "12 * (3 + 4)"})]
    rendered = renderer.render(CONVERSATION, tools)
    # The conversation as the calculator environment's episode has it: the tools in the
    # system prompt, the call in tags, the result as a user message.
    call = '<tool>calculate(expression="(3 + 4) * 5")</tool>'
    episode = [
        *tagged.prompt([CONVERSATION[0]], tools),
        {"role": "assistant", "content": call},
        {"role": "user", "content": '<tool_result name="calculate">\n35\n</tool_result>'},
        CONVERSATION[3],
    ]
    reference = smollm_tokenizer.apply_chat_template(episode, tokenize=False)
    assert smollm_tokenizer.decode(rendered.token_ids) == reference.removesuffix("\n")
    assert _masked_runs(smollm_tokenizer, rendered) == [
        f"{call}<|im_end|>",
        "The answer is \\boxed{35}.<|im_end|>",
    ]
    (parsed,) = tagged.parse(call)
    assert (parsed.name, parsed.arguments) == ("calculate", {"expression": "(3 + 4) * 5"})


def test_a_conversation_without_tools_masks_every_assistant_turn(smollm_tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": "6"},
    ]
    rendered = ConversationRenderer(smollm_tokenizer, "tagged").render(messages)
    reference = smollm_tokenizer.apply_chat_template(messages, tokenize=False)
    assert smollm_tokenizer.decode(rendered.token_ids) == reference.removesuffix("\n")
    assert _masked_runs(smollm_tokenizer, rendered) == ["4<|im_end|>", "6<|im_end|>"]
    assert rendered.num_loss_tokens == 4


def test_tools_described_by_schemas_are_shown_as_the_function_tools_are(smollm_tokenizer):
    schemas = [tool(calculate).schema]
    renderer = ConversationRenderer(smollm_tokenizer, "tagged")
    from_schemas = renderer.render(CONVERSATION, tools_from_schemas(schemas))
    from_function = renderer.render(CONVERSATION, [tool(calculate)])
    assert from_schemas.token_ids.tolist() == from_function.token_ids.tolist()
    with pytest.raises(ConversationError, match=r"tools\[0\] is not a function schema"):
        tools_from_schemas([{"type": "function"}])


USER, ANSWER = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([{"role": "user", "content": "hi"}], "no assistant message"),
        ([{"role": "assistant", "content": "hi"}], "message 0 is the assistant's"),
        ([USER, {"role": "bot", "content": "x"}], "message 1 needs a role"),
        ([{"role": "user", "content": 3}, ANSWER], "content must be text"),
        ([USER, ANSWER, USER], "message 2 \\(user\\) comes after the last assistant turn"),
        (
            [*CONVERSATION[:1], {"role": "assistant", "tool_calls": [
                {"function": {"name": "f", "arguments": "{not json"}}]}],
            "message 1 \\(assistant\\) tool_calls\\[0\\]\\.function\\.arguments is not JSON",
        ),
        (
            [*CONVERSATION[:1], {"role": "assistant", "content": ""}],
            "message 1 \\(assistant\\) has neither content nor tool calls",
        ),
    ],
)  # fmt: skip
def test_a_broken_conversation_is_refused_naming_the_message(smollm_tokenizer, messages, match):
    with pytest.raises(ConversationError, match=match):
        ConversationRenderer(smollm_tokenizer, "tagged").render(messages)


def test_arguments_given_as_an_object_or_as_json_text_render_alike(qwen_tokenizer) -> None:
    # OpenAI's layout keeps arguments as JSON text; the call is written the same either way.
    renderer = ConversationRenderer(qwen_tokenizer, "hermes")
    as_text = json.loads(json.dumps(CONVERSATION))
    as_text[1]["tool_calls"][0]["function"]["arguments"] = '{"expression": "(3 + 4) * 5"}'
    assert (
        renderer.render(as_text).token_ids.tolist()
        == renderer.render(CONVERSATION).token_ids.tolist()
    )
