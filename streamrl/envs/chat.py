"""Chat turns as tokens: the exact token history of an episode across turns.

An episode's next request is the token ids the engine already saw (the prompt, then each
sampled turn exactly as sampled) followed by the ids of what the environment answered — never a
re-tokenisation of the conversation's text. `ChatRenderer` makes those ids with the model's
own chat template:

- `prompt_ids(messages, tools)`: the first request (`tools=` passed to the template, for models
  whose template renders tool schemas).
- `observation_ids(messages, ended_with_eos)`: what follows a sampled turn — the rest of the
  assistant turn's closing (the template's text after the end-of-turn token, such as the newline
  after `<|im_end|>`, or the whole closing when the turn stopped on a stop string and sampled no
  end-of-turn token), the new messages, and the generation prompt of the next assistant turn.
  These are environment tokens (loss mask 0).
- `observation_ids_within(messages, ended_with_eos, max_tokens)`: the same, at most
  `max_tokens` long (`generator.env.observation_max_tokens`): the messages' contents are cut to
  fit, saying so, or None when even the template's own tokens around empty messages do not fit.
  Character limits alone do not bound tokens: text a tokenizer splits badly (rare characters,
  byte soup a degenerate policy echoes through a tool) takes several tokens per character.

The new messages are rendered as the template's *delta*: the template applied to a probe
conversation with and without them, the difference taken as text. That is exact only for
templates that never rewrite earlier turns (appending a message appends text). `ChatRenderer`
checks this when it is built and refuses a template that does not (for instance one that drops
earlier turns' reasoning), naming the model: such a model cannot continue an episode on its
token history.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from streamrl.envs.limits import truncate_all

__all__ = ["ChatRenderer", "TemplateNotAppendOnlyError"]

Message = Mapping[str, Any]

# Probe contents: characters no template adds, so they mark where a message's content sits.
_USER, _ASSISTANT, _OBSERVATION = "\x02user-probe\x03", "\x02assistant-probe\x03", "\x02obs\x03"

_FIT_ATTEMPTS = 4  # renderings with cut contents tried before the contents are emptied


class TemplateNotAppendOnlyError(ValueError):
    """The model's chat template rewrites earlier turns when a message is added."""


class ChatRenderer:
    """Renders prompts and observations of one tokenizer's chat template as token ids."""

    def __init__(self, tokenizer: Any, model_name: str = "the model") -> None:
        self.tokenizer = tokenizer
        self.eos_ids = _end_of_turn_ids(tokenizer)
        self._probe = [
            {"role": "user", "content": _USER},
            {"role": "assistant", "content": _ASSISTANT},
        ]
        closed = self._render(self._probe)
        start = closed.find(_ASSISTANT)
        if start < 0:
            raise TemplateNotAppendOnlyError(
                f"the chat template of {model_name} does not render an assistant message's "
                "content verbatim; multi-turn episodes need one that does"
            )
        self._closed = closed
        self.turn_closing = closed[start + len(_ASSISTANT) :]  # e.g. "<|im_end|>\n"
        for role in ("user", "tool"):
            self._check_append_only(role, model_name)

    def prompt_ids(
        self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        """The first request: `messages` with the assistant's generation prompt."""
        text = self._render(messages, tools=tools, add_generation_prompt=True)
        return self.encode(text)

    def observation_ids(self, messages: Sequence[Message], ended_with_eos: bool) -> list[int]:
        """The ids that follow a sampled assistant turn (module docstring): the rest of the
        turn's closing, `messages`, and the next assistant turn's generation prompt."""
        rendered = self._render([*self._probe, *messages], add_generation_prompt=True)
        delta = rendered[len(self._closed) :]
        closing = self.turn_closing
        if ended_with_eos:  # the sampled end-of-turn token is part of the closing
            eos_text = self.eos_text()
            closing = closing[len(eos_text) :] if closing.startswith(eos_text) else closing
        return self.encode(closing + delta)

    def observation_ids_within(
        self, messages: Sequence[Message], ended_with_eos: bool, max_tokens: int | None
    ) -> list[int] | None:
        """`observation_ids`, at most `max_tokens` long (None: no limit). Longer ones are
        rendered again with the messages' contents cut together (`truncate_all`: fairly, each
        saying what was cut) to the characters that fit at the tokens per character just
        measured, a tenth to spare; after a few tries the contents are emptied. None when even
        empty messages take more than `max_tokens`."""
        ids = self.observation_ids(messages, ended_with_eos)
        if max_tokens is None or len(ids) <= max_tokens:
            return ids
        emptied = [{**m, "content": ""} for m in messages]
        frame = len(self.observation_ids(emptied, ended_with_eos))
        if frame > max_tokens:
            return None
        originals = [m["content"] for m in messages]
        chars = sum(len(c) for c in originals)
        for _ in range(_FIT_ATTEMPTS):
            chars = chars * (max_tokens - frame) // max(len(ids) - frame, 1) * 9 // 10
            contents = truncate_all(originals, chars)
            cut = [{**m, "content": c} for m, c in zip(messages, contents, strict=True)]
            ids = self.observation_ids(cut, ended_with_eos)
            if len(ids) <= max_tokens:
                return ids
            chars = sum(len(c) for c in contents)
        return self.observation_ids(emptied, ended_with_eos)

    def ended_with_eos(self, token_ids: Sequence[int]) -> bool:
        """Whether a sampled turn's last token ends the turn (EOS / end-of-turn)."""
        return len(token_ids) > 0 and int(token_ids[-1]) in self.eos_ids

    # -- internals -------------------------------------------------------------------------

    def _render(self, messages: Sequence[Message], **kwargs: Any) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False, **kwargs)

    def encode(self, text: str) -> list[int]:
        """`text` as token ids, no special tokens added."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def eos_text(self) -> str:
        """The end-of-turn token the template closes an assistant turn with, as text; empty
        when its closing does not start with one."""
        closing_ids = self.encode(self.turn_closing)
        if closing_ids and closing_ids[0] in self.eos_ids:
            return self.tokenizer.decode(closing_ids[:1])
        return ""

    def _check_append_only(self, role: str, model_name: str) -> None:
        extra = {"role": role, "content": _OBSERVATION}
        if role == "tool":
            extra["name"] = "probe"
        after = self._render([*self._probe, extra], add_generation_prompt=True)
        if not after.startswith(self._closed):
            raise TemplateNotAppendOnlyError(
                f"the chat template of {model_name} rewrites earlier turns when a {role} "
                "message is added, so an episode cannot go on from its exact token history. "
                "Use a model whose template only appends (ChatML / Qwen2.5 style), or train "
                "single-turn (generator.env.fn=single_turn)"
            )


def _end_of_turn_ids(tokenizer: Any) -> frozenset[int]:
    """Token ids that end an assistant turn: EOS and the template's end-of-turn tokens."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for name in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
        token_id = tokenizer.convert_tokens_to_ids(name)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id and token_id >= 0:
            ids.add(token_id)
    return frozenset(ids)
