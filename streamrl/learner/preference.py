"""Preference optimization: the learner trained on (prompt, chosen, rejected) pairs.

A run with `preference` set is a preference run. Its learner is the RL learner — the same
models, FSDP2 sharding, LoRA, optimiser and schedule, checkpoints, lease, weight publishing and
metrics — with the data and the loss swapped, as a supervised run swaps them
(`streamrl.learner.supervised`):

- the data: `PreferenceSource` reads the pairs of `data.path` (`streamrl.data.preference`) or
  of a run's own stream (`preference.pairs_from`, `streamrl.learner.stream_pairs`), and the
  held-out ones of `data.val_path`, once, at start, and hands out
  `learner.batch_groups` of them a step in a shuffled order, epoch after epoch; where it stands
  is `TrainingState.sft_position` (examples taken so far), checkpointed, so a resumed run takes
  the same pairs next. A pair is a group of two responses sharing its prompt — chosen first
  (reward 1), rejected second (reward 0) — packed whole into one micro-batch, its prompt computed
  once where the attention allows (`learner.shared_prompt`).
- the loss: `preference_step` is one optimiser update per mini-batch on the mean over its pairs
  of `streamrl.algorithms.preference.pair_loss`, each micro-batch's pairs divided by the
  mini-batch's global pair count, so the gradient is exactly the mini-batch's whatever the
  token budget or the world size. The reference (the stage's starting weights, frozen; the base
  with LoRA; none for simpo) scores every pair once before the first step, its sums kept in
  the run's storage (`preference.reference: cached`, `streamrl.learner.preference_reference`),
  or each micro-batch beside the policy (`on_the_fly`).

Metrics: `pref/loss`, `pref/reward_chosen`, `pref/reward_rejected`, `pref/margin`,
`pref/accuracy` (the fraction of pairs with r_w > r_l), `pref/likelihood_accuracy` (with a higher
mean log-prob for the chosen response: the policy's own preference, meaningful before training
too), the held-out `pref/eval_*` alike,
`pref/pairs`, `pref/epoch`, `actor/grad_norm`, `actor/lr`, `perf/learner_tokens_per_s`.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch

from storage.fs import open_location
from storage.stream.records import ScoredGroup
from streamrl.algorithms.preference import pair_loss, summed_logprobs
from streamrl.algorithms.preference_config import PreferenceConfig
from streamrl.algorithms.reductions import Mean
from streamrl.config.run import RunConfig
from streamrl.data.preference import PairFields, Pairs, load_pairs, pair_group
from streamrl.data.rows import DatasetError
from streamrl.envs.chat import ChatRenderer
from streamrl.learner.forward import token_scores
from streamrl.learner.mini_batches import (
    MicroBatch,
    MiniBatch,
    TrainBatch,
    make_mini_batches,
    shard_for_rank,
)
from streamrl.learner.offline import OfflineLearner
from streamrl.learner.preference_reference import reference_sums
from streamrl.learner.step_inputs import StepModels, StepSettings
from streamrl.learner.step_metrics import StepMetrics
from streamrl.learner.stream_pairs import pairs_stop, stream_pairs
from streamrl.learner.supervised import epoch_order
from streamrl.learner.topology import Topology

__all__ = [
    "PREFERENCE_METRICS",
    "PreferenceLearner",
    "PreferenceSource",
    "preference_step",
]

log = logging.getLogger(__name__)

PREFERENCE_METRICS = (
    "loss", "reward_chosen", "reward_rejected", "margin", "accuracy", "likelihood_accuracy",
)  # fmt: skip


class PreferenceSource:
    """A preference run's pairs (module docstring); every rank reads the same ones and takes the
    same batch, so no data crosses ranks."""

    def __init__(self, config: RunConfig, *, tokenizer: Any, train: Pairs | None = None) -> None:
        pref = config.preference
        assert pref is not None, "a preference source needs the run's preference section"
        self.config = config
        self.chat = ChatRenderer(tokenizer, config.model.path)
        self.fields = PairFields(pref.prompt_field, pref.chosen_field, pref.rejected_field)
        self.train = self._load(config.data.path) if train is None else train
        if not len(self.train):
            raise DatasetError(
                f"no pair of {config.data.path} fits model.max_model_len="
                f"{config.model.max_model_len} ({self.train.dropped} dropped as longer)"
            )
        val_path = config.data.val_path
        try:
            self.heldout = None if val_path is None else self._load(val_path, pref.eval_pairs)
        except DatasetError as problem:
            raise DatasetError(
                f"{problem.problems[0]} (data.val_path: held-out pairs, or null for none)"
            ) from None

    def __len__(self) -> int:
        return len(self.train)

    def batch(self, position: int, size: int, version: int) -> list[ScoredGroup]:
        """The `size` pairs from `position` on (pairs taken so far, over every epoch)."""
        n = len(self.train)
        seed = self.config.data.shuffle_seed
        return [
            pair_group(self.train.pairs[epoch_order(n, seed, k // n)[k % n]], version)
            for k in range(position, position + size)
        ]

    def heldout_groups(self, version: int) -> list[ScoredGroup]:
        return [] if self.heldout is None else [pair_group(p, version) for p in self.heldout.pairs]

    def _load(self, path: str, limit: int | None = None) -> Pairs:
        config = self.config
        pairs = load_pairs(path, self.fields, self.chat, fmt=config.data.format,
                           max_tokens=config.model.max_model_len, limit=limit)  # fmt: skip
        if pairs.dropped:
            log.warning(
                "dropped %d pairs of %s longer than model.max_model_len=%d tokens",
                pairs.dropped, path, config.model.max_model_len,
            )  # fmt: skip
        log.info("pairs %s: %d kept, %d dropped", path, len(pairs), pairs.dropped)
        return pairs


def preference_step(
    models: StepModels,
    mini_batches: list[MiniBatch],
    settings: StepSettings,
    topology: Topology,
    pref: PreferenceConfig,
    reference: torch.Tensor | None = None,
) -> dict[str, float]:
    """One preference step: an optimiser update of the policy per mini-batch on the mean pair
    loss (module docstring); `reference`: `[B, 2]` the batch's pairs' cached reference sums
    (chosen, rejected), None to score them with the reference model. Returns the step's
    metrics."""
    policy, device = models.policy, topology.device
    policy.model.train()
    metrics = StepMetrics(device)
    for mini in mini_batches:
        policy.zero_grad()
        pairs = max(mini.num_responses // 2, 1)  # every rank's, every micro-batch's
        for micro in shard_for_rank(mini, topology.rank, topology.world_size):
            micro = micro.to(device)
            loss, means = _pair_losses(models, micro, settings, pref, reference, grad=True)
            (loss / pairs).backward()
            metrics.add_micro_batch({f"pref/{k}": m for k, m in means.items()}, micro.num_tokens)
        metrics.add_update("actor", policy.update(settings.grad_clip))
    return metrics.reduce(topology, {"actor": policy}, len(mini_batches))


@torch.no_grad()
def heldout_metrics(
    models: StepModels,
    groups: list[ScoredGroup],
    micro_batch_tokens: int,
    settings: StepSettings,
    topology: Topology,
    pref: PreferenceConfig,
    shared_prompt: bool,
    reference: torch.Tensor | None = None,
) -> dict[str, float]:
    """`pref/eval_*` over the held-out pairs `groups` (every rank calls it); `reference` as
    `preference_step` takes it."""
    models.policy.model.eval()
    batch = TrainBatch.from_groups(groups)
    (mini,) = make_mini_batches(batch, batch.num_groups, micro_batch_tokens,
                                shared_prompt=shared_prompt, whole_groups=True)  # fmt: skip
    totals = torch.zeros(len(PREFERENCE_METRICS), 2, dtype=torch.float64)
    for micro in shard_for_rank(mini, topology.rank, topology.world_size):
        micro = micro.to(topology.device)
        _, means = _pair_losses(models, micro, settings, pref, reference, grad=False)
        for row, name in enumerate(PREFERENCE_METRICS):
            totals[row] += torch.stack([means[name].total, means[name].count]).double().cpu()
    totals = topology.all_reduce_sum(totals)
    return {
        f"pref/eval_{name}": float(totals[row, 0] / totals[row, 1])
        for row, name in enumerate(PREFERENCE_METRICS)
        if totals[row, 1] > 0
    }


def _pair_losses(
    models: StepModels,
    micro: MicroBatch,
    settings: StepSettings,
    pref: PreferenceConfig,
    reference: torch.Tensor | None,
    *,
    grad: bool,
) -> tuple[torch.Tensor, dict[str, Mean]]:
    """The summed loss of `micro`'s pairs (differentiable when `grad`) and its metrics' sums.
    A pair's two responses are always in the same micro-batch (`whole_groups`)."""
    chunk = settings.logprob_chunk_tokens
    with torch.set_grad_enabled(grad):
        logp, _ = token_scores(models.policy.model, micro, chunk_tokens=chunk)
    sums, tokens = summed_logprobs(logp, micro.loss_mask)
    chosen = micro.rewards > 0.5
    ref = None
    if pref.needs_reference and reference is not None:  # cached: the pair's row, its column
        table = reference.to(logp.device)
        ref = table[micro.group_index, (~chosen).long()]
    elif pref.needs_reference:
        assert models.reference is not None, f"{pref.loss} needs the reference policy"
        with torch.no_grad():
            ref_logp, _ = token_scores(models.reference, micro, chunk_tokens=chunk)
        ref, _ = summed_logprobs(ref_logp, micro.loss_mask)
    w = torch.nonzero(chosen).squeeze(1)
    lost = torch.nonzero(~chosen).squeeze(1)
    if micro.is_dummy or not len(w):
        zero = logp.sum() * 0.0  # the forward still ran: every rank joins the collectives
        none = torch.zeros((), device=logp.device)
        return zero, {name: Mean(none, none) for name in PREFERENCE_METRICS}
    w = w[torch.argsort(micro.group_index[w])]
    lost = lost[torch.argsort(micro.group_index[lost])]
    if not torch.equal(micro.group_index[w], micro.group_index[lost]):
        raise RuntimeError("a preference pair was split between micro-batches")
    result = pair_loss(
        pref.loss, sums[w], sums[lost], tokens[w], tokens[lost],
        ref_chosen=None if ref is None else ref[w],
        ref_rejected=None if ref is None else ref[lost],
        beta=pref.resolved_beta, label_smoothing=pref.label_smoothing,
        gamma=pref.simpo_gamma, nll_weight=pref.nll_weight,
    )  # fmt: skip
    count = torch.tensor(float(len(w)), device=logp.device)
    means = {
        "loss": Mean(result.loss.detach().sum(), count),
        "reward_chosen": Mean(result.reward_chosen.sum(), count),
        "reward_rejected": Mean(result.reward_rejected.sum(), count),
        "margin": Mean(result.margin.sum(), count),
        "accuracy": Mean((result.margin > 0).float().sum(), count),
        # The policy's own preference, no reference: a higher mean log-prob for the chosen.
        "likelihood_accuracy": Mean(
            (sums[w] / tokens[w].clamp_min(1) > sums[lost] / tokens[lost].clamp_min(1))
            .float()
            .sum()
            .detach(),
            count,
        ),
    }
    return result.loss.sum(), means


class PreferenceLearner(OfflineLearner):
    """The learner of a preference run (module docstring): `OfflineLearner` on pairs with
    `preference_step`."""

    prefix, examples_name, whole_groups = "pref", "pairs", True

    @property
    def pref(self) -> PreferenceConfig:
        assert self.config.preference is not None
        return self.config.preference

    def load_examples(self, tokenizer: Any) -> PreferenceSource:
        source = PreferenceSource(self.config, tokenizer=tokenizer, train=self._stream_pairs())
        self.cached: dict[str, tuple[float, float]] | None = None
        if self.pref.needs_reference and self.pref.reference == "cached":
            heldout = source.heldout.pairs if source.heldout else []
            # Keys by split: a held-out file may name its pairs as the training file does.
            pairs = [replace(p, pair_id=f"train/{p.pair_id}") for p in source.train.pairs] + [
                replace(p, pair_id=f"heldout/{p.pair_id}") for p in heldout
            ]
            self.cached = reference_sums(
                self.run_location, pairs, self.models, self.settings, self.topology,
                micro_batch_tokens=self.config.learner.micro_batch_tokens,
                shared_prompt=self.shared_prompt,
                source=f"{self.pref.pairs_from or self.config.data.path}|"
                f"{self.config.data.val_path}|{self.config.model.path}",
            )  # fmt: skip
            self.models.reference = None  # every pair is scored: the reference is not needed
        return source

    def _stream_pairs(self) -> Pairs | None:
        """The pairs of `preference.pairs_from`'s stream; None when the pairs are data.path's."""
        if self.pref.pairs_from is None:
            return None
        storage = self.config.storage
        source = open_location(self.pref.pairs_from, endpoint_url=storage.endpoint_url,
                               storage_options=storage.storage_options)  # fmt: skip
        stop = self.topology.decide_on_main(lambda: pairs_stop(source, self.run_location))
        found = stream_pairs(source, stop, self.config.model.max_model_len)
        log.info(
            "pairs from the stream of %s: %d of %d groups (%d without a reward difference, %d "
            "multi-turn, %d too long)", source.uri, len(found.pairs), found.groups, found.ties,
            found.multi_turn, found.pairs.dropped,
        )  # fmt: skip
        return found.pairs

    def _table(self, groups: list[ScoredGroup], split: str = "train") -> torch.Tensor | None:
        """`[B, 2]` the cached reference sums of `groups`' pairs; None when not cached."""
        if self.cached is None:
            return None
        rows = [self.cached[f"{split}/{g.prompt_id}"] for g in groups]
        return torch.tensor(rows, dtype=torch.float32)

    @property
    def eval_every(self) -> int:
        return self.pref.eval_every

    def step(self, mini_batches: list[MiniBatch], groups: list[ScoredGroup]) -> dict[str, float]:
        return preference_step(self.models, mini_batches, self.settings, self.topology,
                               self.pref, self._table(groups))  # fmt: skip

    def heldout(self, groups: list[ScoredGroup]) -> dict[str, float]:
        return heldout_metrics(
            self.models, groups, self.config.learner.micro_batch_tokens, self.settings,
            self.topology, self.pref, self.shared_prompt, self._table(groups, "heldout"),
        )  # fmt: skip
