"""From a batch's groups to what each forward pass runs on: the learner's tensor packing.

Consumes the B accepted groups of a `StreamBatch` (`streamrl.learner.batching` chooses them).
Produces their `TrainBatch` of per-response tensors, optimiser `MiniBatch`es of consecutive
groups packed into token-budget `MicroBatch`es with global loss denominators (each micro-batch's
forward rows from `streamrl.learner.packing`), and each rank's share of those.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch
from torch import Tensor

from storage.stream.records import ScoredGroup
from streamrl.algorithms.base import Responses
from streamrl.learner.packing import PAD_ID, forward_rows
from streamrl.learner.reward_history import PastRewards

__all__ = ["MicroBatch", "MiniBatch", "TrainBatch", "make_mini_batches", "shard_for_rank"]


@dataclass(frozen=True)
class TrainBatch:
    """The N responses of B groups, group by group in stream order.

    Per response `[N]`: `group_index` int64 (dense 0..B−1), `rewards` float32, `raw_scores`
    float32, `truncated` bool, `policy_version` int64, `fresh` bool (its group was generated
    by the weights the learner holds: `policy_version` = the learner's version, when the
    batch was built with it), `response_length` int64 (L),
    `prompt_length` int64 (P). Response i is the sequence prompt + response, P + L tokens, at
    `tokens[seq_start[i] : seq_start[i] + P + L]` (`tokens: [Σ(P+L)] int64`); its behaviour
    log-probs are `logprobs[logprob_start[i] : logprob_start[i] + L]` (`logprobs: [ΣL] f32`),
    and `sampled` (`[ΣL] bool`, the same layout) tells the tokens the policy sampled (True)
    from environment tokens of a multi-turn response (False: in the sequence, never scored).
    L counts both. `teacher_logprobs` (`[ΣL] f32`, the layout of `logprobs`): a teacher's
    log-probs of the response tokens (on-policy distillation), or None when no group carries
    them. `past`: the earlier rewards of the groups' prompts that temporal groups pool
    (`streamrl.learner.reward_history`), empty otherwise.
    """

    groups: tuple[ScoredGroup, ...]
    group_index: Tensor
    rewards: Tensor
    raw_scores: Tensor
    truncated: Tensor
    policy_version: Tensor
    fresh: Tensor
    response_length: Tensor
    prompt_length: Tensor
    tokens: Tensor
    seq_start: Tensor
    logprobs: Tensor
    logprob_start: Tensor
    sampled: Tensor
    teacher_logprobs: Tensor | None = None
    past: PastRewards = field(default_factory=PastRewards)

    @classmethod
    def from_groups(
        cls,
        groups: Sequence[ScoredGroup],
        learner_version: int | None = None,
        past: PastRewards | None = None,
    ) -> TrainBatch:
        """Concatenate `groups` (Python loops over responses only, never over tokens);
        `learner_version` tells the fresh groups (none without it); `past`: the earlier
        rewards of their prompts (temporal groups)."""
        sizes = np.array([g.group_size for g in groups], np.int64)
        group_index = np.repeat(np.arange(len(groups)), sizes)
        prompts = [np.asarray(g.prompt_tokens) for g in groups]
        responses = [np.asarray(t) for g in groups for t in g.response_tokens]
        prompt_length = np.repeat([len(p) for p in prompts], sizes)
        response_length = np.array([len(r) for r in responses], np.int64)
        seq_length = prompt_length + response_length
        pieces = [part for i, r in enumerate(responses) for part in (prompts[group_index[i]], r)]
        logprobs = [np.asarray(lp) for g in groups for lp in g.behaviour_logprobs]
        sampled = [m for g in groups for m in g.effective_loss_masks]
        taught = [g.teacher_logprobs is not None for g in groups]
        if any(taught) and not all(taught):
            raise ValueError(
                "a batch mixes groups with and without teacher log-probs; the batch collector "
                "lets only groups a teacher scored through when algorithm.opd is on"
            )

        def flat(arrays: list[np.ndarray], dtype: type) -> Tensor:
            joined = np.concatenate(arrays) if arrays else np.zeros(0)
            return torch.from_numpy(joined.astype(dtype))

        policy_version = torch.from_numpy(np.repeat([g.policy_version for g in groups], sizes))
        return cls(
            groups=tuple(groups),
            group_index=torch.from_numpy(group_index),
            rewards=flat([g.rewards for g in groups], np.float32),
            raw_scores=flat([g.raw_scores for g in groups], np.float32),
            truncated=flat([g.truncated for g in groups], np.bool_),
            policy_version=policy_version.long(),
            fresh=(
                policy_version == learner_version
                if learner_version is not None
                else torch.zeros(len(policy_version), dtype=torch.bool)
            ),
            response_length=torch.from_numpy(response_length),
            prompt_length=torch.from_numpy(prompt_length),
            tokens=flat(pieces, np.int64),
            seq_start=torch.from_numpy(np.cumsum(seq_length) - seq_length),
            logprobs=flat(logprobs, np.float32),
            logprob_start=torch.from_numpy(np.cumsum(response_length) - response_length),
            sampled=flat(sampled, np.bool_),
            teacher_logprobs=(
                flat([np.asarray(lp) for g in groups for lp in g.teacher_logprobs], np.float32)
                if groups and all(taught)
                else None
            ),
            past=past or PastRewards(),
        )

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def responses(self, mini_batches: Sequence[MiniBatch]) -> Responses:
        """What the advantages read of each response (`Responses`), with `mini_batches` (the
        batch's, from `make_mini_batches`) telling each response's optimiser batch."""
        n = len(self.rewards)
        owner = torch.repeat_interleave(torch.arange(n), self.response_length)
        sampled = self.sampled.float()
        lengths = torch.zeros(n).index_add_(0, owner, sampled)
        logp_sums = torch.zeros(n).index_add_(0, owner, self.logprobs * sampled)
        optimiser_batch = torch.zeros(n, dtype=torch.long)
        median_length = torch.zeros(n)
        for k, mini in enumerate(mini_batches):
            optimiser_batch[mini.sample_index] = k
            median_length[mini.sample_index] = mini.median_length
        return Responses(
            rewards=self.rewards.float(),
            scores=self.raw_scores,
            group_index=self.group_index,
            num_groups=self.num_groups,
            lengths=lengths,
            mean_logp_behav=logp_sums / lengths.clamp(min=1.0),
            optimiser_batch=optimiser_batch,
            median_length=median_length,
            past_rewards=self.past.rewards,
            past_group=self.past.group,
        )

    @property
    def seq_length(self) -> Tensor:
        """`[N] int64` P + L, tokens in each response's sequence."""
        return self.prompt_length + self.response_length


@dataclass(frozen=True)
class MicroBatch:
    """n responses for one forward pass: the forward rows, and a per-response view `[n, T−1]`
    of their sequences prompt + response, right-padded to T = the longest.

    The forward rows (`streamrl.learner.packing`): one per response (prompt + response), or,
    with shared prompts, one per group — its prompt once, then its responses.
    input_ids           `[R, S]   int64`  the rows' tokens, padded with PAD_ID (0)
    attention_mask      `[R, S]   int64`  1 on real tokens
    segments            `[R, S]   int64 | None`  shared-prompt rows: −1 padding, 0 prompt, i + 1
                                          response i (who attends to whom: `packing.attends`)
    position_ids        `[R, S]   int64`  each token's position in its response's sequence
    gather              `[n, T−1] int64`  flat index (row · S + position) of the hidden state
                                          scoring targets[i, j], where response_mask

    The per-response view (what the losses read):
    targets             `[n, T−1] int64`  position j scores token j + 1 of prompt + response
    response_mask       `[n, T−1] bool`   True exactly at response targets, j ∈ [P−1, P+L−2],
                                          sampled and environment tokens alike (the layout)
    sampled_mask        `[n, T−1] bool`   response_mask less environment tokens: the targets
                                          the policy sampled, the only ones scored
                                          (`forward`); advantages, returns and GAE run on it
    loss_mask           `[n, T−1] bool`   sampled_mask, less truncated responses if
                                          overlong_filter: every loss term, its denominators,
                                          importance weights, entropy, KL and step metrics
    behaviour_logprobs  `[n, T−1] f32`    generator log-prob of targets[:, j] at response
                                          targets (0 at environment tokens), else 0
    teacher_logprobs    `[n, T−1] f32 | None`  the teacher's, laid out alike (on-policy
                                          distillation), or None: no teacher scored them
    sample_index        `[n]      int64`  row in the TrainBatch (gather advantages with it)
    group_index         `[n]      int64`  group in the batch
    rewards             `[n]      f32`    the response's reward
    positive            `[n]      bool`   its answer is correct (raw score ≥ 1)
    fresh               `[n]      bool`   its group came from the learner's current weights
    num_tokens          loss tokens here, loss_mask.sum()
    is_dummy            a padding micro-batch (one row of two pad tokens, no loss tokens)
    """

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    gather: Tensor
    targets: Tensor
    response_mask: Tensor
    sampled_mask: Tensor
    loss_mask: Tensor
    behaviour_logprobs: Tensor
    sample_index: Tensor
    group_index: Tensor
    rewards: Tensor
    positive: Tensor
    fresh: Tensor
    num_tokens: int
    segments: Tensor | None = None
    teacher_logprobs: Tensor | None = None
    is_dummy: bool = False

    @classmethod
    def dummy(cls) -> MicroBatch:
        ids, no_loss = torch.full((1, 2), PAD_ID), torch.zeros(1, 1, dtype=torch.bool)
        # Attention on: a row with every position masked can turn attention into NaN.
        ones, row = torch.ones_like(ids), torch.zeros(1, dtype=torch.long)
        return cls(
            input_ids=ids,
            attention_mask=ones,
            position_ids=torch.arange(2)[None],
            gather=torch.zeros(1, 1, dtype=torch.long),
            targets=ids[:, 1:].clone(),
            response_mask=no_loss,
            sampled_mask=no_loss,
            loss_mask=no_loss,
            behaviour_logprobs=no_loss.float(),
            sample_index=row,
            group_index=row,
            rewards=torch.zeros(1),
            positive=torch.zeros(1, dtype=torch.bool),
            fresh=torch.zeros(1, dtype=torch.bool),
            num_tokens=0,
            is_dummy=True,
        )

    def to(self, device: torch.device) -> MicroBatch:
        """This micro-batch with every tensor on `device` (itself when already there)."""
        if self.input_ids.device == device:
            return self
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        return replace(self, **moved)


@dataclass(frozen=True)
class MiniBatch:
    """The groups (a range of batch groups) of one optimiser update, their TrainBatch rows
    `sample_index: [n] int64`, and their micro-batches. The global loss denominators
    (docs/algorithms.md "Aggregation") count the whole mini-batch, all micro-batches and so all
    ranks: `num_loss_tokens` (token-mean), `num_responses` (seq-mean-token-sum-norm),
    `num_scored_responses`, those with ≥ 1 loss token (seq-mean-token-mean), and
    `num_positive_tokens`, loss tokens of correct responses (VAPO's positive-example loss);
    and `median_length`, the median sampled length of its loss-bearing responses (eq 30).
    Loss tokens are the micro-batches' `loss_mask`: sampled tokens only, never environment
    tokens."""

    groups: range
    sample_index: Tensor
    micro_batches: tuple[MicroBatch, ...]
    num_loss_tokens: int
    num_responses: int
    num_scored_responses: int
    num_positive_tokens: int = 0
    median_length: float = 0.0


def make_mini_batches(
    batch: TrainBatch,
    mini_batch_groups: int,
    micro_batch_tokens: int,
    *,
    overlong_filter: bool = False,
    shared_prompt: bool = False,
    whole_groups: bool = False,
) -> list[MiniBatch]:
    """Split `batch` into ⌈B / mini_batch_groups⌉ mini-batches of consecutive groups (exactly
    `mini_batch_groups` each when they divide B; else as even as possible, the larger first:
    a length-aware batch closed early, `learner.batch_tokens`), each packed into micro-batches
    of R × S ≤ `micro_batch_tokens` forward tokens: units (a response with its prompt or, with
    `shared_prompt`, a whole group with its prompt once; a group longer than the budget falls
    back to its responses) sorted longest first (ties in batch order), each micro-batch filled
    while one more still fits at its first unit's length.
    Environment tokens (multi-turn) are in the rows and the budget, never in `loss_mask` or
    the denominators; `overlong_filter` drops truncated responses from both too.
    `whole_groups`: a group's units always share a micro-batch (a preference pair's two
    responses, whose loss needs both), packed by the group's rows × its longest unit."""
    lengths = batch.seq_length
    if lengths.numel() and int(lengths.max()) > micro_batch_tokens:
        raise ValueError(
            f"a {int(lengths.max())}-token sequence exceeds the micro-batch budget of "
            f"{micro_batch_tokens} tokens; raise learner.micro_batch_tokens"
        )
    mini_batches = []
    for groups in _group_runs(batch.num_groups, mini_batch_groups):
        in_run = (batch.group_index >= groups.start) & (batch.group_index < groups.stop)
        rows = torch.nonzero(in_run)
        rows = rows.squeeze(1)
        units = _units(batch, rows, micro_batch_tokens if shared_prompt else 0)
        bundles = _bundles(batch, units) if whole_groups else [[u] for u in units]
        widest = [max(_unit_length(batch, u) for u in b) for b in bundles]
        order = torch.sort(torch.tensor(widest, dtype=torch.long), descending=True, stable=True)
        chunks = _pack([widest[i] for i in order.indices.tolist()], micro_batch_tokens,
                       [len(bundles[i]) for i in order.indices.tolist()])  # fmt: skip
        micro = [
            _micro_batch(
                batch,
                [u for i in order.indices[chunk].tolist() for u in bundles[i]],
                overlong_filter,
            )
            for chunk in chunks
        ]
        per_row = torch.cat([m.loss_mask.sum(1) for m in micro])  # loss tokens per response
        sampled = torch.cat([m.sampled_mask.sum(1) for m in micro]).float()
        positive = torch.cat([m.positive for m in micro])
        mini_batches.append(
            MiniBatch(
                groups=groups,
                sample_index=rows,
                micro_batches=tuple(micro),
                num_loss_tokens=int(per_row.sum()),
                num_responses=len(rows),
                num_scored_responses=int((per_row > 0).sum()),
                num_positive_tokens=int(per_row[positive].sum()),
                median_length=_median(sampled[per_row > 0]),
            )
        )
    return mini_batches


def _group_runs(num_groups: int, mini_batch_groups: int) -> list[range]:
    """⌈num_groups / mini_batch_groups⌉ consecutive runs covering the groups, their sizes
    differing by at most one (the larger first)."""
    parts = -(-num_groups // mini_batch_groups)
    size, larger = divmod(num_groups, max(parts, 1))
    runs, first = [], 0
    for k in range(parts):
        stop = first + size + (k < larger)
        runs.append(range(first, stop))
        first = stop
    return runs


def _median(values: Tensor) -> float:
    """The median (the mean of the middle two of an even count); 0 of nothing."""
    if values.numel() == 0:
        return 0.0
    ordered = values.sort().values
    middle = (len(ordered) - 1) / 2
    return float((ordered[int(middle)] + ordered[int(middle + 0.5)]) / 2)


def _units(batch: TrainBatch, rows: Tensor, shared_budget: int) -> list[Tensor]:
    """`rows` as forward units: each response alone, or (`shared_budget` > 0) each group's
    responses together when the group's row fits the budget."""
    if not shared_budget:
        return [rows[i : i + 1] for i in range(len(rows))]
    units: list[Tensor] = []
    for group in torch.unique_consecutive(batch.group_index[rows]).tolist():
        members = rows[batch.group_index[rows] == group]
        if _unit_length(batch, members) <= shared_budget:
            units.append(members)
        else:  # too long for one row: its responses one by one, each with the prompt
            units.extend(members[i : i + 1] for i in range(len(members)))
    return units


def _unit_length(batch: TrainBatch, unit: Tensor) -> int:
    """Tokens of a unit's row: its prompt once plus its responses."""
    return int(batch.prompt_length[unit[0]]) + int(batch.response_length[unit].sum())


def _bundles(batch: TrainBatch, units: list[Tensor]) -> list[list[Tensor]]:
    """`units` (in batch order) gathered by group: the units of one group together."""
    bundles: list[list[Tensor]] = []
    for unit in units:
        group = int(batch.group_index[unit[0]])
        if bundles and int(batch.group_index[bundles[-1][0][0]]) == group:
            bundles[-1].append(unit)
        else:
            bundles.append([unit])
    return bundles


def _pack(sorted_lengths: list[int], budget: int, rows: list[int] | None = None) -> list[slice]:
    """Consecutive runs of longest-first lengths with rows × first length ≤ budget (`rows`:
    each item's forward rows, default one; a run holds at least one item)."""
    rows = rows or [1] * len(sorted_lengths)
    chunks, start = [], 0
    while start < len(sorted_lengths):
        fits, stop, used = budget // max(1, sorted_lengths[start]), start, 0
        while stop < len(sorted_lengths) and (stop == start or used + rows[stop] <= fits):
            used += rows[stop]
            stop += 1
        chunks.append(slice(start, stop))
        start = stop
    return chunks


def _micro_batch(batch: TrainBatch, units: list[Tensor], overlong_filter: bool) -> MicroBatch:
    """Gather the units' responses into the forward rows (`forward_rows`) and the padded
    per-response view `[n, T]` (vectorised, no token loops)."""
    rows = torch.cat(units)
    P, L = batch.prompt_length[rows, None], batch.response_length[rows, None]
    pos = torch.arange(int((P + L).max()))[None, :]
    real = pos < P + L
    at_token = torch.where(real, batch.seq_start[rows, None] + pos, 0)  # index into tokens
    sequences = torch.where(real, batch.tokens[at_token], PAD_ID)
    j = pos[:, :-1]
    response_mask = (j >= P - 1) & (j < P + L - 1)
    at = batch.logprob_start[rows, None] + j - (P - 1)  # index into the flat log-probs
    behaviour_logprobs = torch.zeros(response_mask.shape)
    behaviour_logprobs[response_mask] = batch.logprobs[at[response_mask]]
    teacher_logprobs = None
    if batch.teacher_logprobs is not None:
        teacher_logprobs = torch.zeros(response_mask.shape)
        teacher_logprobs[response_mask] = batch.teacher_logprobs[at[response_mask]]
    sampled_mask = torch.zeros_like(response_mask)
    sampled_mask[response_mask] = batch.sampled[at[response_mask]]
    loss_mask = sampled_mask & ~batch.truncated[rows, None] if overlong_filter else sampled_mask
    forward = forward_rows(
        batch.prompt_length, batch.response_length, batch.tokens, batch.seq_start, units,
        view_length=j.shape[1],
    )  # fmt: skip
    return MicroBatch(
        input_ids=forward.input_ids,
        attention_mask=forward.attention_mask,
        segments=forward.segments,
        position_ids=forward.position_ids,
        gather=forward.gather,
        targets=sequences[:, 1:].contiguous(),
        response_mask=response_mask,
        sampled_mask=sampled_mask,
        loss_mask=loss_mask,
        behaviour_logprobs=behaviour_logprobs,
        teacher_logprobs=teacher_logprobs,
        sample_index=rows,
        group_index=batch.group_index[rows],
        rewards=batch.rewards[rows],
        positive=batch.raw_scores[rows] >= 1.0,
        fresh=batch.fresh[rows],
        num_tokens=int(loss_mask.sum()),
    )


def shard_for_rank(mini_batch: MiniBatch, rank: int, world_size: int) -> list[MicroBatch]:
    """This rank's share of the mini-batch's micro-batches, the same count on every rank.

    FSDP's collectives need every rank to run as many forward/backward passes as the others:
    each gets ⌈M / world_size⌉, padded with `MicroBatch.dummy()` (no loss tokens, zero gradient).
    Micro-batches go largest (n × T) first to the least-loaded rank with room, ties to the lower
    rank: deterministic, so every rank computes the same assignment and takes its own part.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    micro = mini_batch.micro_batches
    per_rank = max(1, -(-len(micro) // world_size))
    load, owned = [0] * world_size, [[] for _ in range(world_size)]
    cost = [m.input_ids.numel() for m in micro]  # n × T, padded tokens
    for i in sorted(range(len(micro)), key=lambda i: (-cost[i], i)):
        open_ranks = [r for r in range(world_size) if len(owned[r]) < per_rank]
        target = min(open_ranks, key=lambda r: (load[r], r))
        owned[target].append(i)
        load[target] += cost[i]
    mine = [micro[i] for i in sorted(owned[rank])]
    return mine + [MicroBatch.dummy() for _ in range(per_rank - len(mine))]
