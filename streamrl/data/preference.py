"""Preference pairs: a prompt, a chosen and a rejected response, from the layouts people have.

`load_pairs(path, fields, renderer)` reads JSONL / Parquet rows (`streamrl.data.rows`) and turns
each into a `Pair` of token ids, checked before any training:

- strings (TRL's standard layout, UltraFeedback's `prompt`): `prompt` is the user's message,
  `chosen` / `rejected` the assistant's answers;
- chat conversations (TRL's conversational layout): `prompt` a list of messages (multi-turn
  allowed), `chosen` / `rejected` a list holding the assistant's final message — or the whole
  conversation, prompt included, as UltraFeedback-binarized stores it (the prompt's messages are
  then its leading ones);
- no `prompt` field (HH-RLHF): `chosen` and `rejected` are whole conversations, as message lists
  or as HH-RLHF's "\\n\\nHuman: … \\n\\nAssistant: …" text; the prompt is what they share,
  the responses their last assistant turns.

Tokens: the prompt is rendered with the model's chat template and its generation prompt — what a
generator sends —, a response is its text and the end-of-turn token — what the policy samples;
every response token is a loss token. A malformed row is a `DatasetError` naming the row and the
field; pairs longer than `max_tokens` (prompt + the longer response) are dropped and counted.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from storage.stream.records import ScoredGroup
from streamrl.data.rows import DatasetError, MissingFieldError, dataset_name, field_value, load_rows

__all__ = [
    "ChatTemplate",
    "Pair",
    "PairFields",
    "Pairs",
    "load_pairs",
    "pair_group",
    "pair_messages",
]

PAIR_GENERATOR_ID = "preference"  # the generator id of a pair's group: no generator made it

_HH_TURN = re.compile(r"\n\n(Human|Assistant): ")


class ChatTemplate(Protocol):
    """What rendering a pair needs of the model's chat template (`streamrl.envs.chat`'s
    `ChatRenderer` is one)."""

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def eos_text(self) -> str: ...


@dataclass(frozen=True)
class PairFields:
    """Where a row keeps its prompt (None: no prompt field, HH-RLHF), chosen and rejected."""

    prompt: str | None = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"


@dataclass(frozen=True)
class Pair:
    """One pair as token ids (`int32`): the prompt, and the chosen and rejected responses."""

    pair_id: str
    prompt: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.chosen) + len(self.rejected)


@dataclass(frozen=True)
class Pairs:
    """The pairs of one dataset that fit, and how many rows were dropped as too long."""

    pairs: list[Pair]
    dropped: int

    def __len__(self) -> int:
        return len(self.pairs)


def load_pairs(
    path: str,
    fields: PairFields,
    chat: ChatTemplate,
    *,
    fmt: str = "auto",
    max_tokens: int,
    limit: int | None = None,
) -> Pairs:
    """The pairs of the dataset at `path` (module docstring), the first `limit` rows."""
    wanted = tuple(f for f in (fields.prompt, fields.chosen, fields.rejected) if f)
    rows = load_rows(path, fmt, fields=wanted)[:limit]
    if not rows:
        raise DatasetError(f"{path} holds no rows: a preference dataset needs pairs")
    name = dataset_name(path)
    eos = chat.encode(chat.eos_text()) if chat.eos_text() else []
    pairs, dropped = [], 0
    for i, row in enumerate(rows):
        where = f"row {i} (0-based) of {path}"
        prompt, chosen, rejected = pair_messages(row, fields, where)
        prompt_ids = chat.prompt_ids(prompt)
        pair = Pair(
            f"{name}:{i}",
            np.asarray(prompt_ids, np.int32),
            np.asarray(chat.encode(chosen) + eos, np.int32),
            np.asarray(chat.encode(rejected) + eos, np.int32),
        )
        if len(pair.prompt) + max(len(pair.chosen), len(pair.rejected)) > max_tokens:
            dropped += 1
            continue
        pairs.append(pair)
    return Pairs(pairs, dropped)


def pair_messages(
    row: Mapping[str, Any], fields: PairFields, where: str
) -> tuple[list[dict[str, Any]], str, str]:
    """A row's prompt messages and its chosen and rejected answers' text (module docstring)."""
    chosen_raw = _value(row, fields.chosen, where, "chosen_field")
    rejected_raw = _value(row, fields.rejected, where, "rejected_field")
    if fields.prompt is None:
        chosen = _conversation(chosen_raw, where, fields.chosen)
        rejected = _conversation(rejected_raw, where, fields.rejected)
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        prompt = chosen[:shared]
        chosen_turn, rejected_turn = chosen[shared:], rejected[shared:]
    else:
        prompt = _prompt(_value(row, fields.prompt, where, "prompt_field"), where, fields.prompt)
        chosen_turn = _response(chosen_raw, prompt, where, fields.chosen)
        rejected_turn = _response(rejected_raw, prompt, where, fields.rejected)
    if not prompt or prompt[-1]["role"] != "user":
        raise DatasetError(
            f"{where}: the prompt must end with a user message (got "
            f"{prompt[-1]['role'] if prompt else 'no message'}); the responses are the "
            "assistant's answer to it"
        )
    chosen_text = _answer(chosen_turn, where, fields.chosen)
    rejected_text = _answer(rejected_turn, where, fields.rejected)
    if chosen_text == rejected_text:
        raise DatasetError(
            f"{where}: '{fields.chosen}' and '{fields.rejected}' are the same answer; a pair "
            "needs two different responses (drop the row)"
        )
    return prompt, chosen_text, rejected_text


def _value(row: Mapping[str, Any], path: str, where: str, option: str) -> Any:
    try:
        return field_value(row, path)
    except MissingFieldError as missing:
        keys = ", ".join(missing.keys) or "none: it is not a mapping"
        raise DatasetError(
            f"{where} has no '{path}' (preference.{option}); its keys are: {keys}"
        ) from None


def _prompt(value: Any, where: str, field: str) -> list[dict[str, Any]]:
    if isinstance(value, str):
        if not value.strip():
            raise DatasetError(f"{where}: '{field}' is empty")
        return [{"role": "user", "content": value}]
    return _messages(value, where, field)


def _response(value: Any, prompt: list[dict[str, Any]], where: str, field: str) -> list[Any]:
    """The response's messages: a string is the assistant's answer; a list either the answer
    alone or the whole conversation starting with the prompt's messages."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    messages = _messages(value, where, field)
    if len(messages) > len(prompt) and messages[: len(prompt)] == prompt:
        return messages[len(prompt) :]
    return messages


def _conversation(value: Any, where: str, field: str) -> list[dict[str, Any]]:
    """A whole conversation: a message list, or HH-RLHF's Human/Assistant text."""
    if not isinstance(value, str):
        return _messages(value, where, field)
    parts = _HH_TURN.split(value)
    if len(parts) < 3 or parts[0].strip():
        raise DatasetError(
            f"{where}: '{field}' is text but not HH-RLHF's '\\n\\nHuman: …\\n\\nAssistant: …' "
            "conversation; without a prompt field (preference.prompt_field: null) chosen and "
            "rejected must be whole conversations"
        )
    roles = {"Human": "user", "Assistant": "assistant"}
    return [
        {"role": roles[parts[k]], "content": parts[k + 1].strip()}
        for k in range(1, len(parts) - 1, 2)
    ]


def _messages(value: Any, where: str, field: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise DatasetError(
            f"{where}: '{field}' must be a string or a non-empty list of chat messages, got "
            f"{type(value).__name__}"
        )
    out = []
    for k, message in enumerate(value):
        if (
            not isinstance(message, Mapping)
            or message.get("role") not in ("system", "user", "assistant")
            or not isinstance(message.get("content"), str)
        ):
            raise DatasetError(
                f"{where}: '{field}'[{k}] must be a message with a role (system, user, "
                f"assistant) and text content, got {str(message)[:120]!r}"
            )
        out.append({"role": message["role"], "content": message["content"]})
    return out


def _answer(turn: Sequence[Mapping[str, Any]], where: str, field: str) -> str:
    if len(turn) != 1 or turn[0]["role"] != "assistant" or not turn[0]["content"].strip():
        raise DatasetError(
            f"{where}: '{field}' must hold one non-empty assistant answer after the prompt, got "
            f"{[m['role'] for m in turn]}"
        )
    return turn[0]["content"]


def pair_group(pair: Pair, version: int) -> ScoredGroup:
    """`pair` as a group of two responses: chosen (reward 1), then rejected (reward 0)."""
    responses = [pair.chosen, pair.rejected]
    return ScoredGroup(
        prompt_id=pair.pair_id,
        prompt_tokens=pair.prompt,
        ground_truth="",
        response_tokens=responses,
        behaviour_logprobs=[np.zeros(len(r), np.float32) for r in responses],
        rewards=np.asarray([1.0, 0.0], np.float32),
        raw_scores=np.asarray([1.0, 0.0], np.float32),
        truncated=np.zeros(2, np.bool_),
        finish_reasons=["done", "done"],
        policy_version=version,
        generator_id=PAIR_GENERATOR_ID,
        created_at=0.0,
        finished_at=0.0,
    )
