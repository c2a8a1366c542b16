"""From stream groups to micro-batches: the learner's data side.

Consumes `ScoredGroup`s (a `StreamReader.groups()` iterator) and the reader's cursor. Produces
a `StreamBatch` of B accepted groups with the cursor after the last one consumed, its
`TrainBatch` of per-response tensors, optimiser `MiniBatch`es of consecutive groups packed into
token-budget `MicroBatch`es with global loss denominators, and each rank's share of those.

Filters, in order (a group dropped by the first is not counted by the second): staleness,
`current_version − policy_version > max_staleness` (a segment whose commit record shows every
group stale arrives as a `SkippedSegment`, never downloaded, and counts as that many stale
groups: the same counts and cursor as reading them); then, with dynamic sampling on, a group
without signal: all responses equally correct (raw verifier scores all equal — for a binary
verifier, not 0 < #correct < G). Correctness decides, never the shaped reward: an all-wrong
group whose overlong penalties differ teaches nothing about correctness. Reading on until B
groups pass *is* DAPO's dynamic sampling, done by streaming.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np
import torch
from torch import Tensor

from storage.records import Cursor, RolloutSums, ScoredGroup
from storage.stream_reader import SkippedSegment
from streamrl.learner.packing import PAD_ID, forward_rows

__all__ = [
    "PAD_ID",
    "BatchCollector",
    "FilterCounts",
    "IncompatibleGroupError",
    "MicroBatch",
    "MiniBatch",
    "RolloutSums",
    "StreamBatch",
    "TrainBatch",
    "make_mini_batches",
    "shard_for_rank",
]


class IncompatibleGroupError(ValueError):
    """A stream group the model cannot train on; the message names the group and the fix."""


@dataclass
class FilterCounts:
    """Groups read from the stream and what the filters did with them; `skipped_segments`
    counts the segments whose groups were all stale by their commit record and were counted in
    `consumed` and `dropped_stale` without being downloaded (how many depends on how far the
    reader had read ahead: the other counts do not)."""

    consumed: int = 0
    accepted: int = 0
    dropped_stale: int = 0
    dropped_zero_var: int = 0
    skipped_segments: int = 0

    def __add__(self, other: FilterCounts) -> FilterCounts:
        return FilterCounts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


@dataclass(frozen=True)
class StreamBatch:
    """B accepted groups in stream order; `cursor_after` is the reader position just past the
    last group consumed (accepted or dropped): checkpoint it to resume at the next group.
    `staleness: [B] int64` = current_version − policy_version per group; `counts` covers this
    batch, `totals` every batch of the collector so far; `consumed` sums the responses of every
    group this batch consumed, accepted or dropped (what the generators produced; a segment
    skipped unread contributes the sums its commit record carries)."""

    groups: tuple[ScoredGroup, ...]
    cursor_after: Cursor
    counts: FilterCounts
    totals: FilterCounts
    staleness: np.ndarray
    consumed: RolloutSums = field(default_factory=RolloutSums)

    def metrics(self) -> dict[str, float]:
        """`stream/staleness_mean`, `_max`, `stream/dropped_stale`, `stream/dropped_zero_var`
        (ALGORITHMS.md), `stream/accepted`, `stream/consumed`, `stream/skipped_segments`;
        `stream/*_total` cumulative; `stream/waste_frac` (consumed but not trained on) and
        `stream/stale_frac` (dropped as stale) over every group consumed so far; `rollout/*`
        over every consumed group and
        `rollout_accepted/*` over the trained ones."""
        counts = {f"stream/{k}": float(v) for k, v in asdict(self.counts).items()}
        totals = {f"stream/{k}_total": float(v) for k, v in asdict(self.totals).items()}
        mean, top = float(self.staleness.mean()), float(self.staleness.max())
        rollout = self.consumed.metrics("rollout")
        accepted = RolloutSums.of(self.groups).metrics("rollout_accepted")
        staleness = {"stream/staleness_mean": mean, "stream/staleness_max": top}
        consumed = max(self.totals.consumed, 1)
        waste = {  # of every group consumed so far: not trained on, dropped as stale
            "stream/waste_frac": (self.totals.consumed - self.totals.accepted) / consumed,
            "stream/stale_frac": self.totals.dropped_stale / consumed,
        }
        return staleness | counts | totals | waste | rollout | accepted


@dataclass
class BatchCollector:
    """Reads groups until `batch_groups` pass the staleness and dynamic-sampling filters.

    Every consumed group that was read is first checked against the model (token ids <
    `vocab_size`, prompt + response ≤ `max_seq_len`); a mismatch raises
    `IncompatibleGroupError` (a stream written for another model is a user error, not data to
    skip). `totals` counts every batch so far: keep it in the learner state and pass it back on
    resume. `oldest_usable(version)` is the staleness rule as a bound, for the stream reader."""

    batch_groups: int
    max_staleness: int
    dynamic_sampling: bool
    vocab_size: int
    max_seq_len: int
    totals: FilterCounts = field(default_factory=FilterCounts)

    def oldest_usable(self, current_version: int) -> int:
        """The oldest policy version a group may have to pass the staleness filter at
        `current_version` (never decreases as the version grows)."""
        return current_version - self.max_staleness

    def collect(
        self,
        groups: Iterator[ScoredGroup | SkippedSegment],
        cursor: Callable[[], Cursor],
        current_version: int,
    ) -> StreamBatch:
        """Consume `groups` until B are accepted, reading `cursor()` after each one. `EOFError`
        if the iterator ends first (a StreamReader raises `StreamTimeoutError` instead)."""
        accepted: list[ScoredGroup] = []
        counts, after, consumed = FilterCounts(), cursor(), RolloutSums()
        oldest = self.oldest_usable(current_version)
        for group in groups:  # a StreamReader's cursor is past `group` once it is yielded
            after = cursor()
            if isinstance(group, SkippedSegment):
                if group.max_policy_version >= oldest:
                    raise ValueError(
                        f"the stream reader skipped segment {group.seq} (versions up to "
                        f"{group.max_policy_version}) although versions ≥ {oldest} are still "
                        "trained on"
                    )
                counts.consumed += group.num_groups
                counts.dropped_stale += group.num_groups
                counts.skipped_segments += 1
                consumed.merge(group.rollout)
                continue
            counts.consumed += 1
            self.check(group)
            consumed.add(group)
            if group.policy_version < oldest:  # current − policy_version > max_staleness
                counts.dropped_stale += 1
            elif self.dynamic_sampling and np.ptp(group.raw_scores) == 0:  # equally correct
                counts.dropped_zero_var += 1
            else:
                accepted.append(group)
                if len(accepted) == self.batch_groups:
                    break
        if len(accepted) < self.batch_groups:
            raise EOFError(f"the stream ended with {len(accepted)}/{self.batch_groups} accepted")
        counts.accepted = len(accepted)
        self.totals = self.totals + counts
        staleness = np.array([current_version - g.policy_version for g in accepted], np.int64)
        totals = replace(self.totals)
        return StreamBatch(tuple(accepted), after, counts, totals, staleness, consumed)

    def check(self, group: ScoredGroup) -> None:
        """Raise `IncompatibleGroupError` if the model cannot train on `group`."""
        where = f"group {group.prompt_id!r} from generator {group.generator_id!r}"
        hint = "was the stream written with another tokenizer/model?"
        pieces = [np.asarray(group.prompt_tokens), *map(np.asarray, group.response_tokens)]
        tokens = np.concatenate(pieces)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise IncompatibleGroupError(
                f"{where} holds token id {int(tokens.max())} outside the model's vocabulary "
                f"[0, {self.vocab_size}); {hint}"
            )
        longest = len(pieces[0]) + max(len(p) for p in pieces[1:])
        if longest > self.max_seq_len:
            raise IncompatibleGroupError(
                f"{where} has a {longest}-token prompt + response, longer than the model's "
                f"max_seq_len {self.max_seq_len}; {hint} (else raise model.max_model_len)"
            )


@dataclass(frozen=True)
class TrainBatch:
    """The N responses of B groups, group by group in stream order.

    Per response `[N]`: `group_index` int64 (dense 0..B−1), `rewards` float32, `raw_scores`
    float32, `truncated` bool, `policy_version` int64, `response_length` int64 (L),
    `prompt_length` int64 (P). Response i is the sequence prompt + response, P + L tokens, at
    `tokens[seq_start[i] : seq_start[i] + P + L]` (`tokens: [Σ(P+L)] int64`); its behaviour
    log-probs are `logprobs[logprob_start[i] : logprob_start[i] + L]` (`logprobs: [ΣL] f32`).
    """

    groups: tuple[ScoredGroup, ...]
    group_index: Tensor
    rewards: Tensor
    raw_scores: Tensor
    truncated: Tensor
    policy_version: Tensor
    response_length: Tensor
    prompt_length: Tensor
    tokens: Tensor
    seq_start: Tensor
    logprobs: Tensor
    logprob_start: Tensor

    @classmethod
    def from_groups(cls, groups: Sequence[ScoredGroup]) -> TrainBatch:
        """Concatenate `groups` (Python loops over responses only, never over tokens)."""
        sizes = np.array([g.group_size for g in groups], np.int64)
        group_index = np.repeat(np.arange(len(groups)), sizes)
        prompts = [np.asarray(g.prompt_tokens) for g in groups]
        responses = [np.asarray(t) for g in groups for t in g.response_tokens]
        prompt_length = np.repeat([len(p) for p in prompts], sizes)
        response_length = np.array([len(r) for r in responses], np.int64)
        seq_length = prompt_length + response_length
        pieces = [part for i, r in enumerate(responses) for part in (prompts[group_index[i]], r)]
        logprobs = [np.asarray(lp) for g in groups for lp in g.behaviour_logprobs]

        def flat(arrays: list[np.ndarray], dtype: type) -> Tensor:
            joined = np.concatenate(arrays) if arrays else np.zeros(0)
            return torch.from_numpy(joined.astype(dtype))

        return cls(
            groups=tuple(groups),
            group_index=torch.from_numpy(group_index),
            rewards=flat([g.rewards for g in groups], np.float32),
            raw_scores=flat([g.raw_scores for g in groups], np.float32),
            truncated=flat([g.truncated for g in groups], np.bool_),
            policy_version=torch.from_numpy(np.repeat([g.policy_version for g in groups], sizes)),
            response_length=torch.from_numpy(response_length),
            prompt_length=torch.from_numpy(prompt_length),
            tokens=flat(pieces, np.int64),
            seq_start=torch.from_numpy(np.cumsum(seq_length) - seq_length),
            logprobs=flat(logprobs, np.float32),
            logprob_start=torch.from_numpy(np.cumsum(response_length) - response_length),
        )

    @property
    def num_groups(self) -> int:
        return len(self.groups)

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
    block_mask          `[R, 1, S, S] bool | None`  who attends to whom in shared-prompt rows
    position_ids        `[R, S]   int64`  each token's position in its response's sequence
    gather              `[n, T−1] int64`  flat index (row · S + position) of the hidden state
                                          scoring targets[i, j], where response_mask

    The per-response view (what the losses read):
    targets             `[n, T−1] int64`  position j scores token j + 1 of prompt + response
    response_mask       `[n, T−1] bool`   True exactly at response targets, j ∈ [P−1, P+L−2]
    loss_mask           `[n, T−1] bool`   response_mask, less truncated responses if
                                          overlong_filter (returns and GAE use response_mask)
    behaviour_logprobs  `[n, T−1] f32`    generator log-prob of targets[:, j] there, else 0
    sample_index        `[n]      int64`  row in the TrainBatch (gather advantages with it)
    group_index         `[n]      int64`  group in the batch
    rewards             `[n]      f32`    the response's reward
    positive            `[n]      bool`   its answer is correct (raw score ≥ 1)
    num_tokens          loss tokens here, loss_mask.sum()
    is_dummy            a padding micro-batch (one row of two pad tokens, no loss tokens)
    """

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    gather: Tensor
    targets: Tensor
    response_mask: Tensor
    loss_mask: Tensor
    behaviour_logprobs: Tensor
    sample_index: Tensor
    group_index: Tensor
    rewards: Tensor
    positive: Tensor
    num_tokens: int
    block_mask: Tensor | None = None
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
            loss_mask=no_loss,
            behaviour_logprobs=no_loss.float(),
            sample_index=row,
            group_index=row,
            rewards=torch.zeros(1),
            positive=torch.zeros(1, dtype=torch.bool),
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
    (ALGORITHMS.md "Aggregation") count the whole mini-batch, all micro-batches and so all
    ranks: `num_loss_tokens` (token-mean), `num_responses` (seq-mean-token-sum-norm),
    `num_scored_responses`, those with ≥ 1 loss token (seq-mean-token-mean), and
    `num_positive_tokens`, loss tokens of correct responses (VAPO's positive-example loss)."""

    groups: range
    sample_index: Tensor
    micro_batches: tuple[MicroBatch, ...]
    num_loss_tokens: int
    num_responses: int
    num_scored_responses: int
    num_positive_tokens: int = 0


def make_mini_batches(
    batch: TrainBatch,
    mini_batch_groups: int,
    micro_batch_tokens: int,
    *,
    overlong_filter: bool = False,
    shared_prompt: bool = False,
) -> list[MiniBatch]:
    """Split `batch` into B / mini_batch_groups mini-batches of consecutive groups, each packed
    into micro-batches of R × S ≤ `micro_batch_tokens` forward tokens: units (a response with
    its prompt or, with `shared_prompt`, a whole group with its prompt once; a group longer
    than the budget falls back to its responses) sorted longest first (ties in batch order),
    each micro-batch filled while one more still fits at its first unit's length.
    `overlong_filter` drops truncated responses from `loss_mask` and the denominators."""
    if batch.num_groups % mini_batch_groups:
        raise ValueError(
            f"{batch.num_groups} groups do not split into mini-batches of {mini_batch_groups}; "
            "batch_groups must be a multiple of learner.mini_batch_groups"
        )
    lengths = batch.seq_length
    if lengths.numel() and int(lengths.max()) > micro_batch_tokens:
        raise ValueError(
            f"a {int(lengths.max())}-token sequence exceeds the micro-batch budget of "
            f"{micro_batch_tokens} tokens; raise learner.micro_batch_tokens"
        )
    mini_batches = []
    for first in range(0, batch.num_groups, mini_batch_groups):
        groups = range(first, first + mini_batch_groups)
        rows = torch.nonzero((batch.group_index >= first) & (batch.group_index < groups.stop))
        rows = rows.squeeze(1)
        units = _units(batch, rows, micro_batch_tokens if shared_prompt else 0)
        unit_length = torch.tensor([_unit_length(batch, u) for u in units], dtype=torch.long)
        order = torch.sort(unit_length, descending=True, stable=True).indices
        chunks = _pack(unit_length[order].tolist(), micro_batch_tokens)
        micro = [
            _micro_batch(batch, [units[i] for i in order[chunk].tolist()], overlong_filter)
            for chunk in chunks
        ]
        per_row = torch.cat([m.loss_mask.sum(1) for m in micro])  # loss tokens per response
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
            )
        )
    return mini_batches


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


def _pack(sorted_lengths: list[int], budget: int) -> list[slice]:
    """Consecutive runs of longest-first lengths with count × first length ≤ budget."""
    chunks, start = [], 0
    while start < len(sorted_lengths):
        size = max(1, budget // max(1, sorted_lengths[start]))
        chunks.append(slice(start, min(start + size, len(sorted_lengths))))
        start = chunks[-1].stop
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
    loss_mask = response_mask & ~batch.truncated[rows, None] if overlong_filter else response_mask
    behaviour_logprobs = torch.zeros(response_mask.shape)
    at = batch.logprob_start[rows, None] + j - (P - 1)  # index into the flat log-probs
    behaviour_logprobs[response_mask] = batch.logprobs[at[response_mask]]
    forward = forward_rows(
        batch.prompt_length, batch.response_length, batch.tokens, batch.seq_start, units,
        view_length=j.shape[1],
    )  # fmt: skip
    return MicroBatch(
        input_ids=forward.input_ids,
        attention_mask=forward.attention_mask,
        block_mask=forward.block_mask,
        position_ids=forward.position_ids,
        gather=forward.gather,
        targets=sequences[:, 1:].contiguous(),
        response_mask=response_mask,
        loss_mask=loss_mask,
        behaviour_logprobs=behaviour_logprobs,
        sample_index=rows,
        group_index=batch.group_index[rows],
        rewards=batch.rewards[rows],
        positive=batch.raw_scores[rows] >= 1.0,
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
