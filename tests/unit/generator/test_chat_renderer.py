"""ChatRenderer: an episode's token history across turns is exact — the prompt ids, each turn's
sampled ids as sampled, and the rendered observations concatenate to what the chat template
makes of the whole conversation — and templates that rewrite earlier turns are refused."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from streamrl.envs.chat import ChatRenderer, TemplateNotAppendOnlyError
from streamrl.models import resolve_model_path

BUNDLED = ["tiny-qwen2", "smollm2-135m-instruct"]

# Like templates that drop earlier turns' reasoning: an assistant turn followed by a later
# message is rendered changed (here without its first character).
REWRITING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ '<|im_start|>assistant\\n' + m['content'][1:] + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)


@pytest.fixture(scope="module", params=BUNDLED)
def tokenizer(request):
    return AutoTokenizer.from_pretrained(resolve_model_path(request.param))


def _sampled(tokenizer, text: str, *, eos: bool) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [*ids, tokenizer.convert_tokens_to_ids("<|im_end|>")] if eos else ids


def test_two_turns_with_a_tool_concatenate_to_the_templated_conversation(tokenizer):
    renderer = ChatRenderer(tokenizer)
    user = {"role": "user", "content": "What is 17 * 23?"}
    turn1, turn2 = '<tool>calculate(expression="17*23")</tool>', "The answer is 391."
    tool = {"role": "tool", "name": "calculate", "content": "391"}

    history = renderer.prompt_ids([user])
    first = _sampled(tokenizer, turn1, eos=True)
    assert renderer.ended_with_eos(first)
    history += first + renderer.observation_ids([tool], ended_with_eos=True)
    history += _sampled(tokenizer, turn2, eos=True)

    expected = tokenizer.apply_chat_template(
        [user, {"role": "assistant", "content": turn1}, tool,
         {"role": "assistant", "content": turn2}],
        tokenize=False,
    )  # fmt: skip
    assert tokenizer.decode(history) == expected.removesuffix("\n")  # the closing's newline
    # The sampled ids are kept as sampled: they sit in the history unchanged.
    start = len(renderer.prompt_ids([user]))
    assert history[start : start + len(first)] == first


def test_a_turn_stopped_by_a_stop_string_gets_the_whole_closing(tokenizer):
    renderer = ChatRenderer(tokenizer)
    sampled = _sampled(tokenizer, "Guess: 40", eos=False)
    assert not renderer.ended_with_eos(sampled)
    user = {"role": "user", "content": "higher"}
    ids = renderer.observation_ids([user], ended_with_eos=False)
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_end|>\n<|im_start|>user\nhigher<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n")
    with_eos = tokenizer.decode(renderer.observation_ids([user], ended_with_eos=True))
    assert with_eos == text.removeprefix("<|im_end|>")


def test_a_template_that_rewrites_earlier_turns_is_refused():
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny-qwen2"))
    tokenizer.chat_template = REWRITING_TEMPLATE
    with pytest.raises(TemplateNotAppendOnlyError, match="rewrites earlier turns"):
        ChatRenderer(tokenizer, "a rewriting model")
