"""Prompt datasets: rows from JSONL / Parquet (any fsspec URL) or a bundled set, as `Prompt`s.

A row's prompt is a string or a list of chat messages (the verl / DAPO-Math-17k Parquet
layout: `prompt` = [{role, content}], `reward_model` = {ground_truth, style}, `data_source`,
...), reached with the dotted paths `DataConfig.prompt_field` / `answer_field`. Prompts are
rendered with the tokenizer's chat template (generation prompt appended) and tokenised once, at
load: a bad row fails before any engine starts, and prompts longer than `max_prompt_len`
tokens are dropped and counted (`PromptSource.num_dropped_too_long`).

Iteration order, for N generators that must never duplicate work:

- epoch e visits every kept prompt once, in a permutation seeded by (shuffle_seed, e): the same
  on every restart, different from epoch to epoch;
- generator `shard` of `num_shards` takes positions shard, shard + num_shards, ... of that
  permutation, so the shards of one epoch are disjoint and together cover the dataset;
- iteration is endless: after its share of epoch e a shard goes on with epoch e + 1;
- `PromptPosition(epoch, offset)` is the place of the next prompt: `offset` counts the prompts
  this shard has already taken in `epoch`. `PromptIterator.position` reports it, and
  `iterate(..., start=position)` resumes exactly there; `skip=` names positions after `start`
  to pass over (prompts already done: a generator's groups finish out of order). A position is
  meaningful only for the same dataset, shuffle_seed, max_prompt_len, tokenizer and num_shards.
  The run's configuration pins the settings; `PromptSource.fingerprint` names the prompts
  themselves (their ids, token ids and answers, in order), so a restart can tell that the file
  or bundled set behind the same `data.path` changed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import random
import re
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from streamrl.data.config import DataConfig
from streamrl.data.reasoning_gym import REASONING_GYM_PREFIX, reasoning_gym_rows
from streamrl.data.rows import (
    DatasetError,
    MissingFieldError,
    dataset_name,
    field_value,
    load_rows,
)

__all__ = ["Prompt", "PromptIterator", "PromptPosition", "PromptSource", "task_name"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    """One prompt as a generator submits it.

    Invariants: `token_ids` is `text` tokenised (non-empty, at most max_prompt_len long);
    `prompt_id` is unique within the dataset and stable across restarts ("<dataset>:<row>").
    """

    prompt_id: str
    text: str
    token_ids: list[int]
    ground_truth: str
    messages: tuple[dict[str, str], ...] = ()  # the chat messages `text` renders
    task: str | None = None  # the row's `data.task_field`, as `task_name` makes it
    task_level: int | None = None  # its difficulty level (reasoning-gym rows)
    row: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)
    """The row's other fields (not the prompt's or the answer's, which can be large and are
    here already), for fields an environment reads itself (`streamrl.envs.base.Task.row`)."""


@dataclass(frozen=True, order=True)
class PromptPosition:
    """Where a shard's iteration stands: the next prompt is number `offset` of `epoch`."""

    epoch: int = 0
    offset: int = 0


class PromptSource:
    """A dataset's prompts, rendered and tokenised, with sharded endless iteration.

    `tokenizer_path` is a model directory or bundled model name (see `resolve_model_path`);
    `tokenizer` (a transformers tokenizer) may be passed instead. `path` overrides
    `config.path` (e.g. with `config.val_path`). `rows`: the dataset's rows, read by the caller
    (a verifiers environment's own dataset, `data.path: verifiers:<split>`:
    `streamrl.envs.verifiers_data`), in place of reading `path`.
    """

    def __init__(
        self,
        config: DataConfig,
        tokenizer_path: str | None = None,
        *,
        tokenizer: Any = None,
        path: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        rows: list[dict[str, Any]] | None = None,
    ) -> None:
        if tokenizer is None:
            if tokenizer_path is None:
                raise ValueError("PromptSource needs a tokenizer_path or a tokenizer")
            from transformers import AutoTokenizer

            from streamrl.models import resolve_model_path

            tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(tokenizer_path))
        self.config, self.tokenizer = config, tokenizer
        self.path = path or config.path
        self.procedural = self.path.startswith(REASONING_GYM_PREFIX)
        if rows is None and self.procedural:
            rows = reasoning_gym_rows(self.path, config.reasoning_gym)
        elif rows is None:
            rows = load_rows(
                self.path,
                config.format,
                fields=(config.prompt_field, *config.answer_fields),
                optional=() if config.task_field is None else (config.task_field,),
                storage_options=storage_options,
            )
        self.num_rows = len(rows)
        self.prompts, self.num_dropped_too_long = self._prepare(rows, tokenizer)
        log.info(
            "dataset %s: %d rows, %d prompts kept, %d dropped as longer than %d tokens",
            self.path,
            self.num_rows,
            len(self.prompts),
            self.num_dropped_too_long,
            config.max_prompt_len,
        )

    def __len__(self) -> int:
        return len(self.prompts)

    @functools.cached_property
    def fingerprint(self) -> str:
        """The kept prompts' `fingerprint`, computed once when a generator first asks."""
        return fingerprint(self.prompts)

    def _answer(self, row: Mapping[str, Any], index: int) -> Any:
        """The row's `answer_field`; several fields: an object of their values by path."""
        if isinstance(self.config.answer_field, str):
            return self._field(row, index, self.config.answer_field, "answer_field")
        return {
            path: self._field(row, index, path, "answer_field")
            for path in self.config.answer_fields
        }

    def _field(self, row: Mapping[str, Any], index: int, path: str, option: str) -> Any:
        try:
            return field_value(row, path)
        except MissingFieldError as missing:
            where = f"'{missing.where}'" if missing.where else "the row"
            keys = ", ".join(missing.keys) or "none: it is not a mapping"
            raise DatasetError(
                f"row {index} (0-based) of {self.path} has no value at '{path}' "
                f"(data.{option}); the keys of {where} are: {keys}. Set data.{option}=... to "
                "the right dotted field"
            ) from None

    def prompt_of(self, row: Mapping[str, Any], prompt_id: str) -> Prompt | None:
        """One more row as a `Prompt` with id `prompt_id`, rendered and tokenised as the
        dataset's are (a curriculum's prompt at another level); None when it is longer than
        `max_prompt_len` tokens."""
        messages, text = self._render(row, 0, self.tokenizer)
        ids = self.tokenizer(text, add_special_tokens=not self.config.apply_chat_template)
        ids = list(ids["input_ids"])
        if not ids or len(ids) > self.config.max_prompt_len:
            return None
        answer = self._answer(row, 0)
        truth = answer if isinstance(answer, str) else json.dumps(answer)
        level = row.get("extra_info", {}).get("level") if self.procedural else None
        task = self._task(row)
        return Prompt(prompt_id, text, ids, truth, tuple(messages), task, level, self._rest(row))

    def _rest(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """The row without the fields of its prompt and answer (`Prompt.row`)."""
        used = {
            path.split(".")[0] for path in (self.config.prompt_field, *self.config.answer_fields)
        }
        return {key: value for key, value in row.items() if key not in used}

    def _task(self, row: Mapping[str, Any]) -> str | None:
        """The row's task (`data.task_field`), made a metric-safe name; None without one."""
        if self.config.task_field is None:
            return None
        try:
            value = field_value(row, self.config.task_field)
        except MissingFieldError:
            return None
        return task_name(str(value))

    def _render(
        self, row: Mapping[str, Any], index: int, tokenizer: Any
    ) -> tuple[list[dict[str, str]], str]:
        """The row's prompt as chat messages (`data.system_prompt` applied) and as text."""
        cfg = self.config
        prompt = self._field(row, index, cfg.prompt_field, "prompt_field")
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list) and all(
            isinstance(m, Mapping) and isinstance(m.get("content"), str) and "role" in m
            for m in prompt
        ):
            messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
        else:
            raise DatasetError(
                f"row {index} of {self.path}: '{cfg.prompt_field}' must be a string or a list "
                f"of {{role, content}} chat messages, got {type(prompt).__name__}"
            )
        if cfg.system_prompt is not None:  # replaces a system message the row brings
            start = 1 if messages and messages[0]["role"] == "system" else 0
            messages = [{"role": "system", "content": cfg.system_prompt}, *messages[start:]]
        if cfg.apply_chat_template:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            return messages, text
        if len(messages) > 2 or messages[-1]["role"] != "user":
            raise DatasetError(
                f"row {index} of {self.path} is a multi-turn conversation but "
                "data.apply_chat_template is false; set data.apply_chat_template=true"
            )
        return messages, "\n\n".join(m["content"] for m in messages)

    def _prepare(self, rows: list[dict[str, Any]], tokenizer: Any) -> tuple[list[Prompt], int]:
        cfg = self.config
        if cfg.apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise DatasetError(
                "the tokenizer has no chat template; set data.apply_chat_template=false or use "
                "model.tokenizer=<a directory whose tokenizer has one>"
            )
        rendered = [self._render(row, i, tokenizer) for i, row in enumerate(rows)]
        texts = [text for _, text in rendered]
        answers = [self._answer(row, i) for i, row in enumerate(rows)]
        # A chat template writes its own special tokens; plain text gets the tokenizer's (BOS).
        token_ids = tokenizer(texts, add_special_tokens=not cfg.apply_chat_template)["input_ids"]
        name = dataset_name(self.path)
        if self.procedural:
            name = f"reasoning_gym-{cfg.reasoning_gym.split}"
        prompts, dropped = [], 0
        for index, ((messages, text), ids, answer) in enumerate(
            zip(rendered, token_ids, answers, strict=True)
        ):
            if not ids:
                raise DatasetError(f"row {index} of {self.path} has an empty prompt")
            if len(ids) > cfg.max_prompt_len:
                dropped += 1
                continue
            truth = answer if isinstance(answer, str) else json.dumps(answer)
            task, row = self._task(rows[index]), rows[index]
            level = row["extra_info"]["level"] if self.procedural and task else None
            prompts.append(
                Prompt(
                    f"{name}:{index}",
                    text,
                    list(ids),
                    truth,
                    tuple(messages),
                    task,
                    level,
                    self._rest(row),
                )
            )
        if not prompts:
            raise DatasetError(
                f"no prompt of {self.path} fits data.max_prompt_len={cfg.max_prompt_len} "
                f"({dropped} of {len(rows)} rows dropped as longer); raise data.max_prompt_len"
            )
        if dropped:
            log.warning(
                "dropped %d of %d prompts longer than %d tokens",
                dropped,
                len(rows),
                cfg.max_prompt_len,
            )
        return prompts, dropped

    def epoch_order(self, epoch: int) -> list[int]:
        """The permutation of prompt indices visited in `epoch` (before sharding)."""
        order = list(range(len(self.prompts)))
        random.Random(f"streamrl-data:{self.config.shuffle_seed}:{epoch}").shuffle(order)
        return order

    def iterate(
        self,
        shard: int = 0,
        num_shards: int = 1,
        start: PromptPosition | None = None,
        skip: Collection[PromptPosition] = (),
    ) -> PromptIterator:
        """Endless iterator over this shard's prompts, from `start` (default: the beginning),
        passing over the positions in `skip`."""
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} is outside 0..{num_shards - 1}")
        if num_shards > len(self.prompts):
            raise DatasetError(
                f"{num_shards} generators share a dataset of {len(self.prompts)} prompts, so "
                "some would get none; use fewer generators (generator.count) or more prompts"
            )
        return PromptIterator(self, shard, num_shards, start or PromptPosition(), skip)


def task_name(value: str) -> str:
    """A row's task as metrics name it (`storage.stream.scored_group.TASK_NAME`): characters
    other than letters, digits, '_', '.' and '-' become '_' ("openai/gsm8k" → "openai_gsm8k"),
    at most 64 of them."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", value)[:64]
    return name if name[:1].isalnum() else f"t{name}"[:64]


def fingerprint(prompts: Sequence[Prompt]) -> str:
    """What a prompt position refers to: the prompts' count and a digest of their ids, token ids
    and answers, in order ("<n> prompts, sha256:<first 16 hex digits>")."""
    digest = hashlib.sha256()
    for prompt in prompts:
        digest.update(
            json.dumps([prompt.prompt_id, prompt.token_ids, prompt.ground_truth]).encode()
        )
    return f"{len(prompts)} prompts, sha256:{digest.hexdigest()[:16]}"


class PromptIterator(Iterator[Prompt]):
    """One shard's endless walk over a `PromptSource`; `position` is where the next prompt is
    (never one of the `skip` positions)."""

    def __init__(
        self,
        source: PromptSource,
        shard: int,
        num_shards: int,
        start: PromptPosition,
        skip: Collection[PromptPosition] = (),
    ) -> None:
        if start.epoch < 0 or start.offset < 0:
            raise ValueError(f"a prompt position is never negative, got {start}")
        self.source, self.shard, self.num_shards = source, shard, num_shards
        self._epoch, self._offset = start.epoch, start.offset
        self._order = self._shard_order(self._epoch)
        if self._offset > len(self._order):
            raise ValueError(
                f"offset {self._offset} is past the {len(self._order)} prompts of shard {shard} "
                f"in epoch {self._epoch}"
            )
        self._skip = set(skip)
        self._pass_skipped()

    def _shard_order(self, epoch: int) -> list[int]:
        return self.source.epoch_order(epoch)[self.shard :: self.num_shards]

    @property
    def position(self) -> PromptPosition:
        """The next prompt's place; pass it to `PromptSource.iterate(start=...)` to resume."""
        if self._offset == len(self._order):
            return PromptPosition(self._epoch + 1, 0)
        return PromptPosition(self._epoch, self._offset)

    def _pass_skipped(self) -> None:
        """Move past the positions to skip (each is skipped once, then forgotten)."""
        while self._skip and (position := self.position) in self._skip:
            self._skip.remove(position)
            if position.epoch != self._epoch:
                self._order = self._shard_order(position.epoch)
            self._epoch, self._offset = position.epoch, position.offset + 1

    def __next__(self) -> Prompt:
        if self._offset == len(self._order):
            self._epoch, self._offset = self._epoch + 1, 0
            self._order = self._shard_order(self._epoch)
        prompt = self.source.prompts[self._order[self._offset]]
        self._offset += 1
        self._pass_skipped()
        return prompt
