"""Supervised fine-tuning: the learner trained on chat conversations instead of a replay stream.

A run with `sft` set is a supervised run. Its learner is the RL learner — the same models,
FSDP2 sharding, LoRA, optimiser and schedule, checkpoints, lease, weight publishing and metrics
— with two parts swapped:

- the data: `SupervisedSource` renders the conversations of `data.path` (and the held-out ones
  of `data.val_path`) once, at start, with the model's chat template and the environment's
  tool format (`streamrl.envs.conversations`), and hands out `learner.batch_groups` of them a
  step in a shuffled order, epoch after epoch (permutation seeded by data.shuffle_seed and the
  epoch, as prompts are). Where it stands is `TrainingState.sft_position` (conversations taken
  so far), checkpointed: a resumed run takes the same conversations next. Each conversation
  becomes a one-response group (`conversation_group`), so the learner's packing to
  `learner.micro_batch_tokens` and its mini-batches are the RL path's own. Conversations longer
  than `model.max_model_len` are dropped and counted.
- the loss: `supervised_step` is one optimiser update per mini-batch on the token-mean negative
  log-likelihood of the assistant's tokens (loss mask 1), each micro-batch's share divided by
  the mini-batch's global token count, so the gradient is exactly the mini-batch's whatever the
  token budget or the world size. `heldout_loss` is the same NLL without gradients.

Metrics: `sft/loss` (token-mean NLL of the step's conversations), `sft/heldout_loss`,
`sft/tokens`, `sft/conversations`, `sft/epoch`, `actor/grad_norm`, `actor/lr`,
`perf/learner_tokens_per_s`.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from storage.stream.records import ScoredGroup
from streamrl.algorithms.reductions import Mean
from streamrl.config.run import RunConfig
from streamrl.data.rows import DatasetError, MissingFieldError, dataset_name, field_value, load_rows
from streamrl.envs.conversations import (
    ConversationError,
    ConversationRenderer,
    RenderedConversation,
    tools_from_schemas,
)
from streamrl.envs.formats import resolve_tool_format
from streamrl.envs.tools import Tool, as_tool
from streamrl.learner.forward import token_scores
from streamrl.learner.mini_batches import MiniBatch, TrainBatch, make_mini_batches, shard_for_rank
from streamrl.learner.offline import OfflineLearner
from streamrl.learner.step_inputs import StepModels, StepSettings
from streamrl.learner.step_metrics import StepMetrics
from streamrl.learner.topology import Topology

__all__ = [
    "SupervisedLearner",
    "SupervisedSource",
    "conversation_group",
    "epoch_order",
    "heldout_loss",
    "supervised_step",
]

log = logging.getLogger(__name__)

SFT_GENERATOR_ID = "sft"  # the generator id of a conversation's group: no generator made it


def epoch_order(count: int, seed: int, epoch: int) -> list[int]:
    """The order in which a dataset of `count` examples is visited in `epoch` (seeded by
    `data.shuffle_seed` and the epoch, as prompts are)."""
    order = list(range(count))
    random.Random(f"streamrl-sft:{seed}:{epoch}").shuffle(order)
    return order


def conversation_group(
    conversation: RenderedConversation, prompt_id: str, version: int
) -> ScoredGroup:
    """`conversation` as a group of one response: the prompt is everything before the
    assistant's first token; the response the rest, its loss mask the conversation's (0 at
    what the environment or the user said between turns). No rewards: SFT needs none."""
    p = conversation.prompt_length
    response = conversation.token_ids[p:]
    return ScoredGroup(
        prompt_id=prompt_id,
        prompt_tokens=conversation.token_ids[:p],
        ground_truth="",
        response_tokens=[response],
        behaviour_logprobs=[np.zeros(len(response), np.float32)],
        rewards=np.zeros(1, np.float32),
        raw_scores=np.zeros(1, np.float32),
        truncated=np.zeros(1, np.bool_),
        finish_reasons=["done"],
        policy_version=version,
        generator_id=SFT_GENERATOR_ID,
        created_at=0.0,
        finished_at=0.0,
        loss_masks=[conversation.loss_mask[p:]],
    )


@dataclass(frozen=True)
class Conversations:
    """The rendered conversations of one dataset, with their ids, and how many rows were
    dropped as longer than the model's context."""

    ids: list[str]
    rendered: list[RenderedConversation]
    dropped: int

    def __len__(self) -> int:
        return len(self.rendered)


class SupervisedSource:
    """A supervised run's conversations (module docstring); every rank renders the same ones
    and takes the same batch, so no data crosses ranks."""

    def __init__(self, config: RunConfig, *, tokenizer: Any) -> None:
        self.config = config
        sft = config.sft
        assert sft is not None, "a supervised source needs the run's sft section"
        template = getattr(tokenizer, "chat_template", None)
        fmt = resolve_tool_format(config.generator.env.tool_format, template)
        self.renderer = ConversationRenderer(tokenizer, fmt, config.model.path)
        self.env_tools = _environment_tools(config) if sft.tools == "environment" else None
        self.train = self._load(config.data.path)
        if not len(self.train):
            raise DatasetError(
                f"no conversation of {config.data.path} fits model.max_model_len="
                f"{config.model.max_model_len} ({self.train.dropped} dropped as longer)"
            )
        val_path, limit = config.data.val_path, sft.eval_conversations
        try:
            self.heldout = None if val_path is None else self._load(val_path, limit)
        except DatasetError as problem:
            raise DatasetError(
                f"{problem.problems[0]} (data.val_path: held-out conversations, or null for none)"
            ) from None

    def __len__(self) -> int:
        return len(self.train)

    def batch(self, position: int, size: int, version: int) -> list[ScoredGroup]:
        """The `size` conversations from `position` on (conversations taken so far, over every
        epoch), as groups of one."""
        n = len(self.train)
        groups = []
        for k in range(position, position + size):
            index = self.epoch_order(k // n)[k % n]
            groups.append(
                conversation_group(self.train.rendered[index], self.train.ids[index], version)
            )
        return groups

    def epoch_order(self, epoch: int) -> list[int]:
        """The permutation of the conversations visited in `epoch`."""
        return epoch_order(len(self.train), self.config.data.shuffle_seed, epoch)

    def heldout_groups(self, version: int) -> list[ScoredGroup]:
        if self.heldout is None:
            return []
        return [
            conversation_group(c, i, version)
            for i, c in zip(self.heldout.ids, self.heldout.rendered, strict=True)
        ]

    def _load(self, path: str, limit: int | None = None) -> Conversations:
        sft, max_len = self.config.sft, self.config.model.max_model_len
        fields = (sft.messages_field, *((sft.tools_field,) if sft.tools == "row" else ()))
        rows = load_rows(path, self.config.data.format, fields=fields)[:limit]
        name = dataset_name(path)
        ids, rendered, dropped = [], [], 0
        for i, row in enumerate(rows):
            conversation = self._render(row, i, path)
            if len(conversation.token_ids) > max_len:
                dropped += 1
                continue
            ids.append(f"{name}:{i}")
            rendered.append(conversation)
        if dropped:
            log.warning(
                "dropped %d of %d conversations of %s longer than model.max_model_len=%d tokens",
                dropped, len(rows), path, max_len,
            )  # fmt: skip
        tokens = sum(c.num_loss_tokens for c in rendered)
        log.info(
            "conversations %s: %d rows, %d kept, %d assistant tokens",
            path, len(rows), len(rendered), tokens,
        )  # fmt: skip
        return Conversations(ids, rendered, dropped)

    def _render(self, row: Mapping[str, Any], index: int, path: str) -> RenderedConversation:
        sft = self.config.sft
        where = f"row {index} (0-based) of {path}"
        messages = _field(row, sft.messages_field, where, "sft.messages_field")
        tools: Sequence[Tool] = self.env_tools or ()
        if sft.tools == "row":
            try:
                schemas = field_value(row, sft.tools_field)
            except MissingFieldError:
                schemas = None
            if schemas is not None:
                if not isinstance(schemas, list):
                    raise DatasetError(
                        f"{where}: '{sft.tools_field}' (sft.tools_field) must be a list of tool "
                        f"schemas, got {type(schemas).__name__}"
                    )
                tools = _tools(schemas, f"{where}: {sft.tools_field}")
        try:
            return self.renderer.render(messages, tools)
        except ConversationError as problem:
            raise DatasetError(f"{where}: {problem}") from None


def supervised_step(
    models: StepModels,
    mini_batches: list[MiniBatch],
    settings: StepSettings,
    topology: Topology,
) -> dict[str, float]:
    """One SFT step: an optimiser update of the policy per mini-batch on the token-mean NLL of
    its assistant tokens (module docstring). Returns the step's metrics."""
    policy, device = models.policy, topology.device
    policy.model.train()
    metrics = StepMetrics(device)
    for mini in mini_batches:
        policy.zero_grad()
        for micro in shard_for_rank(mini, topology.rank, topology.world_size):
            micro = micro.to(device)
            nll, tokens = _nll(policy.model, micro, settings)
            (nll / max(mini.num_loss_tokens, 1)).backward()
            metrics.add_micro_batch({"sft/loss": Mean(nll.detach(), tokens)}, int(tokens))
        metrics.add_update("actor", policy.update(settings.grad_clip))
    return metrics.reduce(topology, {"actor": policy}, len(mini_batches))


@torch.no_grad()
def heldout_loss(
    models: StepModels,
    groups: list[ScoredGroup],
    micro_batch_tokens: int,
    settings: StepSettings,
    topology: Topology,
) -> float:
    """The token-mean NLL of `groups`' assistant tokens under the policy (every rank calls it:
    each scores its share, the sums are reduced)."""
    model = models.policy.model
    model.eval()
    batch = TrainBatch.from_groups(groups)
    (mini,) = make_mini_batches(batch, batch.num_groups, micro_batch_tokens)
    total = torch.zeros(2, dtype=torch.float64)
    for micro in shard_for_rank(mini, topology.rank, topology.world_size):
        nll, tokens = _nll(model, micro.to(topology.device), settings)
        total += torch.stack([nll.double().cpu(), tokens.double().cpu()])
    total = topology.all_reduce_sum(total)
    return float(total[0] / total[1]) if total[1] > 0 else math.nan


def _nll(model: torch.nn.Module, micro: Any, settings: StepSettings) -> tuple[torch.Tensor, Any]:
    """The summed negative log-likelihood of `micro`'s assistant tokens, and their count."""
    logp, _ = token_scores(model, micro, chunk_tokens=settings.logprob_chunk_tokens)
    mask = micro.loss_mask.bool()
    return -torch.where(mask, logp, 0.0).sum(), mask.sum()


def _field(row: Mapping[str, Any], path: str, where: str, option: str) -> Any:
    try:
        return field_value(row, path)
    except MissingFieldError as missing:
        keys = ", ".join(missing.keys) or "none: it is not a mapping"
        raise DatasetError(
            f"{where} has no value at '{path}' ({option}); its keys are: {keys}. Set "
            f"{option}=... to the conversation's field"
        ) from None


def _tools(schemas: list[Any], where: str) -> list[Tool]:
    try:
        return tools_from_schemas(schemas, where)
    except ConversationError as problem:
        raise DatasetError(str(problem)) from None


def _environment_tools(config: RunConfig) -> list[Tool]:
    """The tools `generator.env.fn` lists (sft.tools=environment): only a registered
    environment's, since the learner runs no user code."""
    from streamrl.envs.registry import ENVIRONMENTS, resolve_env
    from streamrl.envs.tool_env import ToolEnvironment

    name = config.generator.env.fn
    if name not in ENVIRONMENTS:
        raise DatasetError(
            f"sft.tools=environment takes the tools of a registered environment "
            f"({', '.join(sorted(ENVIRONMENTS))}); {name!r} is a user's class, which the learner "
            "does not import. Put the tools' schemas in the rows (sft.tools=row)"
        )
    cls = resolve_env(name)
    tools = list(getattr(cls, "tools", ())) if issubclass(cls, ToolEnvironment) else []
    if not tools:
        raise DatasetError(
            f"environment {name!r} lists no tools on its class (sft.tools=environment); put "
            "the tools' schemas in the rows (sft.tools=row)"
        )
    return [as_tool(t) for t in tools]


class SupervisedLearner(OfflineLearner):
    """The learner of a supervised run (module docstring): `OfflineLearner` on conversations
    with `supervised_step`."""

    prefix, examples_name = "sft", "conversations"

    def load_examples(self, tokenizer: Any) -> SupervisedSource:
        return SupervisedSource(self.config, tokenizer=tokenizer)

    @property
    def eval_every(self) -> int:
        assert self.config.sft is not None
        return self.config.sft.eval_every

    def step(self, mini_batches: list[MiniBatch], groups: list[ScoredGroup]) -> dict[str, float]:
        return supervised_step(self.models, mini_batches, self.settings, self.topology)

    def heldout(self, groups: list[ScoredGroup]) -> dict[str, float]:
        budget = self.config.learner.micro_batch_tokens
        loss = heldout_loss(self.models, groups, budget, self.settings, self.topology)
        return {"sft/heldout_loss": loss}
