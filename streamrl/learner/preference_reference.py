"""The reference's log-probs of every training pair, computed once and kept in the run's storage
(`preference.reference: cached`).

DPO and IPO compare the policy with a frozen reference; what they need of it is, per pair, the
reference's summed log-probs of the chosen and the rejected response. They never change, so a
preference run with `preference.reference: cached` scores every training pair once, before its
first step — a forward pass without gradients, the pairs packed as training packs them, each
rank scoring its share — and stores the sums as `<run>/preference/reference.json`; its steps
then run the policy alone. A resumed run reads the file back instead of scoring again, after
checking it: its format, a checksum of its values, and that it was made for the same pairs
(dataset, pair ids) and the same starting model; anything else is scored anew (a warning says
why). Values are stored as JSON numbers, which hold a float32 exactly.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence

import torch

from storage.fs import Location
from streamrl.data.preference import Pair, pair_group
from streamrl.learner.mini_batches import TrainBatch, make_mini_batches, shard_for_rank
from streamrl.learner.step_inputs import StepModels, StepSettings
from streamrl.learner.topology import Topology

__all__ = ["REFERENCE_FILE", "reference_sums"]

log = logging.getLogger(__name__)

REFERENCE_FILE = ("preference", "reference.json")
FORMAT = "streamrl.preference.reference.v1"
CHUNK_PAIRS = 64  # pairs scored together


def reference_sums(
    run: Location,
    pairs: Sequence[Pair],
    models: StepModels,
    settings: StepSettings,
    topology: Topology,
    *,
    micro_batch_tokens: int,
    shared_prompt: bool,
    source: str,
) -> dict[str, tuple[float, float]]:
    """Pair id → the reference's summed log-probs of (chosen, rejected): read from the run's
    storage when it holds them for these pairs and this `source` (dataset and model), else
    scored (every rank calls it) and stored by rank 0."""
    ids = [p.pair_id for p in pairs]
    fingerprint = _fingerprint(source, ids)
    stored = topology.decide_on_main(lambda: _read(run, fingerprint, len(ids)))
    if stored is not None:
        where = run.join(*REFERENCE_FILE)
        log.info("reference log-probs of %d pairs read from %s", len(ids), where)
        return dict(zip(ids, stored, strict=True))
    sums = _score(pairs, models, settings, topology, micro_batch_tokens, shared_prompt)
    values = [(float(chosen), float(rejected)) for chosen, rejected in sums.tolist()]
    if topology.is_main:
        _write(run, fingerprint, values)
        log.info("reference log-probs of %d pairs scored and stored", len(ids))
    return dict(zip(ids, values, strict=True))


@torch.no_grad()
def _score(
    pairs: Sequence[Pair],
    models: StepModels,
    settings: StepSettings,
    topology: Topology,
    budget: int,
    shared_prompt: bool,
) -> torch.Tensor:
    """`[len(pairs), 2]` float32: each pair's reference sums, every rank scoring its share."""
    from streamrl.algorithms.preference import summed_logprobs
    from streamrl.learner.forward import token_scores

    assert models.reference is not None, "cached reference log-probs need the reference policy"
    out = torch.zeros(len(pairs), 2, dtype=torch.float32)
    for start in range(0, len(pairs), CHUNK_PAIRS):
        groups = [pair_group(p, 0) for p in pairs[start : start + CHUNK_PAIRS]]
        batch = TrainBatch.from_groups(groups)
        (mini,) = make_mini_batches(batch, batch.num_groups, budget, shared_prompt=shared_prompt,
                                    whole_groups=True)  # fmt: skip
        for micro in shard_for_rank(mini, topology.rank, topology.world_size):
            micro = micro.to(topology.device)
            chunk = settings.logprob_chunk_tokens
            logp, _ = token_scores(models.reference, micro, chunk_tokens=chunk)
            if micro.is_dummy:
                continue
            sums, _ = summed_logprobs(logp, micro.loss_mask)
            column = (micro.rewards < 0.5).long().cpu()  # chosen 0, rejected 1
            out[start + micro.group_index.cpu(), column] = sums.float().cpu()
    return topology.all_reduce_sum(out)


def _fingerprint(source: str, ids: list[str]) -> str:
    return hashlib.sha256(json.dumps([source, ids]).encode()).hexdigest()


def _checksum(values: list[list[float]]) -> str:
    return hashlib.sha256(json.dumps(values).encode()).hexdigest()


def _read(run: Location, fingerprint: str, count: int) -> list[tuple[float, float]] | None:
    """The stored sums when the file is whole and made for these pairs; None (said why)
    otherwise."""
    path = run.join(*REFERENCE_FILE)
    try:
        record = json.loads(run.fs.cat_file(path))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("the stored reference log-probs (%s) cannot be read (%r): scoring again",
                    path, exc)  # fmt: skip
        return None
    values = record.get("sums") if isinstance(record, dict) else None
    problem = None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        problem = "an unknown format"
    elif record.get("fingerprint") != fingerprint:
        problem = "other pairs or another model"
    elif (
        not isinstance(values, list)
        or len(values) != count
        or not all(isinstance(v, list) and len(v) == 2 for v in values)
        or record.get("checksum") != _checksum(values)
    ):
        problem = "values that fail their checksum"
    if problem is not None:
        log.warning("the stored reference log-probs (%s) hold %s: scoring again", path, problem)
        return None
    return [(float(chosen), float(rejected)) for chosen, rejected in values]


def _write(run: Location, fingerprint: str, values: list[tuple[float, float]]) -> None:
    rows = [list(v) for v in values]
    record = {"format": FORMAT, "fingerprint": fingerprint, "checksum": _checksum(rows),
              "sums": rows}  # fmt: skip
    if run.is_local:
        run.fs.makedirs(run.join(REFERENCE_FILE[0]), exist_ok=True)
    run.fs.pipe_file(run.join(*REFERENCE_FILE), json.dumps(record).encode())
