"""The shared-prompt exactness check on 2 gloo ranks (run by torchrun from
test_shared_prompt.py), and the helpers that test shares with it.

    torchrun --nproc_per_node 2 shared_prompt_worker.py --out DIR ALGORITHM...

Every rank trains the FSDP2-sharded tiny model once per algorithm and token budget, on today's
path and on the fast one (shared-prompt rows, response-only LM head), from the same weights;
rank 0 writes `<out>/rank0.json`: per algorithm, for each budget, `compare()`'s result.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from streamrl.config.loading import load_config
from streamrl.learner.forward import use_hidden_states_head
from streamrl.learner.mini_batches import TrainBatch, make_mini_batches
from streamrl.learner.model import load_policy, load_value_model, shard_model
from streamrl.learner.step import (
    StepModels,
    StepSettings,
    Trainable,
    train_on_batch,
)
from streamrl.learner.topology import Topology, exit_process
from tests.stream_data import random_group

PRESETS = ("grpo", "dr_grpo", "dapo", "rloo", "gpg", "reinforce_pp", "vapo")
MAX_TOKENS = 24
# 4096: every group in one micro-batch; 120: a few groups per micro-batch; 40: groups too long
# for one row fall back to a row per response (the two paths then cut the batch differently).
BUDGETS = (4096, 120, 40)


def config_for(algorithm: str):
    extra = ["model.critic.init_from=policy"] if algorithm == "vapo" else []
    return load_config(
        [algorithm, "tiny-cpu"],
        overrides=[f"generator.max_tokens={MAX_TOKENS}", "data.max_prompt_len=16", *extra],
    )


def batch_with_edge_cases(vocab: int) -> TrainBatch:
    """Groups of 4 with truncated responses, a group whose responses are one token long, and a
    group of one response."""
    rng = np.random.default_rng(7)
    groups = [
        random_group(rng, prompt_id=f"p{i}", vocab=vocab, max_len=MAX_TOKENS, prompt_len=10 + i)
        for i in range(3)
    ]
    groups.append(random_group(rng, prompt_id="short", vocab=vocab, min_len=1, max_len=1))
    groups.append(random_group(rng, prompt_id="alone", vocab=vocab, group_size=1, max_len=9))
    groups.append(random_group(rng, prompt_id="p9", vocab=vocab, max_len=MAX_TOKENS))
    for group in groups:  # correct exactly when rewarded, and both in every group of several
        group.raw_scores[:] = (group.rewards > 0).astype(np.float32)
        if group.group_size > 1:
            group.rewards[:2] = [1.0, -1.0]
            group.raw_scores[:2] = [1.0, 0.0]
    return TrainBatch.from_groups(groups)


def models_for(config, *, fast: bool, topology: Topology | None = None) -> StepModels:
    """Policy (+ critic, + a perturbed reference) from fixed seeds, trained by SGD at lr 1;
    `fast`: with the hidden-states head (response-only, chunked LM head); with a `topology`
    of several ranks, sharded with FSDP2 as the learner shards them."""
    torch.manual_seed(0)
    policy = load_policy("tiny-qwen2", config.model)
    reference = copy.deepcopy(policy).requires_grad_(False).eval()
    with torch.no_grad():  # a reference that differs, so KL terms are not zero
        for p in reference.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    if fast:
        use_hidden_states_head(policy)
        use_hidden_states_head(reference)
    critic = None
    if config.algorithm.uses_value_model:
        critic = load_value_model("tiny-qwen2", config.model, seed=0)
    if topology is not None and topology.world_size > 1:
        policy, reference = shard_model(policy, topology), shard_model(reference, topology)
        critic = shard_model(critic, topology) if critic is not None else None
    models = StepModels(Trainable(policy, torch.optim.SGD(policy.parameters(), lr=1.0)))
    if config.algorithm.needs_reference:
        models.reference = reference
    if critic is not None:
        models.critic = Trainable(critic, torch.optim.SGD(critic.parameters(), lr=1.0))
    return models


def one_update(config, *, fast: bool, budget: int, topology) -> tuple[list, dict]:
    """Train on the edge-case batch once: (parameter updates, metrics)."""
    models = models_for(config, fast=fast, topology=topology)
    batch = batch_with_edge_cases(models.policy.model.config.vocab_size)
    minis = make_mini_batches(
        batch, batch.num_groups, budget, overlong_filter=config.algorithm.overlong.filter,
        shared_prompt=fast,
    )  # fmt: skip
    trained = [models.policy.model] + ([models.critic.model] if models.critic else [])
    before = _parameters(trained, topology)
    settings = StepSettings(temperature=0.9, max_response_len=MAX_TOKENS, grad_clip=None)
    metrics = train_on_batch(models, batch, minis, config.algorithm, settings, topology)
    after = _parameters(trained, topology)
    return [a - b for a, b in zip(after, before, strict=True)], metrics


def _parameters(models: list, topology: Topology) -> list[torch.Tensor]:
    """Every parameter, whole (gathered from every rank when sharded)."""
    if topology.world_size == 1:
        return [p.detach().clone() for m in models for p in m.parameters()]
    return [
        tensor.clone()
        for m in models
        for tensor in get_model_state_dict(
            m, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        ).values()
    ]


def compare(today: tuple[list, dict], fast: tuple[list, dict]) -> dict:
    """How one training's update and metrics differ from another's (the fast path's from
    today's; an option's on 2 ranks from 1): the largest update difference, the largest
    update, and the metrics that differ by more than 1e-5 (absolute and relative) or exist in
    one only."""
    (updates_a, metrics_a), (updates_b, metrics_b) = today, fast
    worst = max(float((a - b).abs().max()) for a, b in zip(updates_a, updates_b, strict=True))
    mismatches = sorted(set(metrics_a) ^ set(metrics_b))
    for name in set(metrics_a) & set(metrics_b):
        a, b = float(metrics_a[name]), float(metrics_b[name])
        if abs(a - b) > 1e-5 + 1e-5 * abs(a) and not (math.isnan(a) and math.isnan(b)):
            mismatches.append(f"{name}: {a} vs {b}")
    return {
        "max_update_diff": worst,
        "max_update": max(float(u.abs().max()) for u in updates_a),
        "metric_mismatches": mismatches,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("algorithms", nargs="+")
    args = parser.parse_args()
    with Topology.from_env("cpu") as topology:
        results = {}
        for algorithm in args.algorithms:
            config = config_for(algorithm)
            results[algorithm] = []
            for budget in BUDGETS:  # every rank trains; rank 0 holds the gathered updates
                today = one_update(config, fast=False, budget=budget, topology=topology)
                fast = one_update(config, fast=True, budget=budget, topology=topology)
                if topology.is_main:
                    results[algorithm].append({"budget": budget, **compare(today, fast)})
        if topology.is_main:
            Path(args.out, "rank0.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
    exit_process(0)  # no interpreter teardown for gloo's threads to race
