"""A learner step's metrics: accumulated per micro-batch on each rank, reduced once over all
ranks at the end of the step (one all-reduce).

* Losses that are each micro-batch's exact share of its mini-batch's loss are summed, then
  averaged over mini-batches: the mean loss of the step's updates.
* Every other per-micro-batch metric is a token mean: weighted by the micro-batch's loss
  tokens over every micro-batch of every rank, unless it says how else it reduces
  (`streamrl.algorithms.reductions`: a `Mean` of its own counts, an `Extreme`).
* Explained variance is a ratio: its statistics are summed, and divided once
  (`explained_variance_from_stats`).
* Per update: gradient norm (mean over updates) and skipped updates (non-finite norm).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import Tensor

from streamrl.algorithms.losses import explained_variance_from_stats
from streamrl.algorithms.reductions import Extreme, Mean, StepMetric
from streamrl.learner.step_inputs import Trainable
from streamrl.learner.topology import Topology

__all__ = ["StepMetrics"]

# Losses that are each micro-batch's exact share of the mini-batch's value: summed, not averaged.
_EXACT = ("actor/pg_loss", "actor/kl_loss", "actor/nll_loss", "critic/vf_loss")


class StepMetrics:
    """The running sums of one step's metrics on this rank."""

    def __init__(self, device: torch.device) -> None:
        self._weighted: dict[str, Tensor] = defaultdict(
            lambda: torch.zeros((), dtype=torch.float64)
        )
        self._exact: dict[str, Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
        self._tokens = torch.zeros((), dtype=torch.float64)
        self._means: dict[str, Tensor] = defaultdict(lambda: torch.zeros(2, dtype=torch.float64))
        self._largest: dict[tuple[str, bool], Tensor] = defaultdict(
            lambda: torch.tensor(-torch.inf, dtype=torch.float64)
        )  # an Extreme's maximum, or minus its minimum
        self._value_stats = torch.zeros(5, dtype=torch.float64, device=device)
        self._updates: dict[str, list[tuple[float, bool]]] = defaultdict(list)

    def add_micro_batch(
        self, metrics: dict[str, StepMetric], num_tokens: int, value_stats: Tensor | None = None
    ) -> None:
        """One micro-batch's metrics (scalars, `Mean`s, `Extreme`s), its loss tokens, and its
        critic's `explained_variance_stats` when a critic trained."""
        for name, value in metrics.items():
            if isinstance(value, Mean):
                pair = torch.stack([value.total.detach(), value.count.detach()])
                self._means[name] += pair.double().cpu()
                continue
            if isinstance(value, Extreme):
                signed = value.value.detach().double().cpu() * (1 if value.largest else -1)
                self._largest[(name, value.largest)] = torch.maximum(
                    self._largest[(name, value.largest)], signed
                )
                continue
            value = value.detach().double().cpu()
            if name in _EXACT:
                self._exact[name] += value
            else:
                self._weighted[name] += value * num_tokens
        self._tokens += num_tokens
        if value_stats is not None:
            self._value_stats += value_stats

    def add_update(self, prefix: str, result: tuple[float, bool]) -> None:
        """One optimiser update of the `prefix` model: (gradient norm, applied)."""
        self._updates[prefix].append(result)

    def reduce(
        self, topology: Topology, trained: dict[str, Trainable], num_mini_batches: int
    ) -> dict[str, float]:
        """The step's metrics over all ranks (a collective: every rank calls it). `trained`:
        the models that learned this step, by metric prefix (actor, critic)."""
        out: dict[str, float] = {}
        w_names, e_names, m_names = sorted(self._weighted), sorted(self._exact), sorted(self._means)
        local = torch.cat(
            [
                torch.stack(
                    [
                        self._tokens,
                        *(self._weighted[n] for n in w_names),
                        *(self._exact[n] for n in e_names),
                    ]
                ),
                *(self._means[n] for n in m_names),
            ]
        )
        totals = topology.all_reduce_sum(local)
        total_tokens = max(float(totals[0]), 1.0)
        for name, value in zip(w_names, totals[1 : 1 + len(w_names)], strict=True):
            out[name] = float(value) / total_tokens
        start = 1 + len(w_names)
        for name, value in zip(e_names, totals[start : start + len(e_names)], strict=True):
            out[name] = float(value) / num_mini_batches
        pairs = totals[start + len(e_names) :].view(-1, 2)
        for name, (total, count) in zip(m_names, pairs.tolist(), strict=True):
            if count > 0:  # no response or token it averages over: no value
                out[name] = total / count
        out.update(self._reduce_extremes(topology))
        if "critic" in trained:
            stats = topology.all_reduce_sum(self._value_stats)
            out["critic/explained_var"] = explained_variance_from_stats(stats)
            out["critic/lr"] = trained["critic"].lr
        for prefix, results in self._updates.items():
            out[f"{prefix}/grad_norm"] = sum(norm for norm, _ in results) / len(results)
            out[f"{prefix}/skipped_updates"] = float(sum(not applied for _, applied in results))
            out[f"{prefix}/skipped_updates_total"] = float(trained[prefix].skipped_total)
        if "actor" in trained:
            out["actor/lr"] = trained["actor"].lr
        return out

    def _reduce_extremes(self, topology: Topology) -> dict[str, float]:
        """Each `Extreme`'s value over all ranks (one all-reduce); left out where no
        micro-batch anywhere had one."""
        keys = sorted(self._largest)  # the same on every rank: a dummy micro-batch adds them too
        local = torch.stack([self._largest[k] for k in keys]) if keys else torch.zeros(0)
        top = topology.all_reduce_max(local.double())
        return {
            name: value if largest else -value
            for (name, largest), value in zip(keys, top.tolist(), strict=True)
            if math.isfinite(value)
        }
