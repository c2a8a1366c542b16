"""One rank of the two-rank FSDP2 checkpoint test (run by torchrun from test_checkpoints.py).

    torchrun --nproc_per_node 2 fsdp_worker.py --phase save|resume \\
        --uri RUN_URI --steps K --out DIR

Both phases build the same tiny policy MLP (with dropout and input noise, so the RNG matters)
and a value head, each `fully_shard`ed, with AdamW. `save` trains K steps on fixed data,
checkpoints, then runs steps K and K+1; `resume` loads checkpoint K in a fresh job and runs
steps K and K+1 (after checking that a save whose learner state differs between ranks fails
on every rank). Each rank writes the losses of those two steps (computed before each update)
to `<out>/<phase>-rank<r>.json`; the test compares them for exact equality.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from storage.checkpoints.dcp import CheckpointStore, LearnerState, ModelState
from storage.fs import StorageError, open_location
from streamrl.learner.topology import exit_process

FEATURES, HIDDEN, BATCH = 16, 32, 8


def build(seed: int) -> tuple[nn.Module, nn.Module]:
    """Policy MLP and value head, identically initialised on every rank, then sharded."""
    torch.manual_seed(seed)
    policy = nn.Sequential(
        nn.Linear(FEATURES, HIDDEN),
        nn.GELU(),
        nn.Dropout(0.2),
        nn.Linear(HIDDEN, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, 1),  # a [1, HIDDEN] weight: rank 1 holds an empty shard
    )
    value = nn.Linear(FEATURES, 1)
    for layer in policy:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(policy)
    fully_shard(value)
    return policy, value


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=["save", "resume"], required=True)
    parser.add_argument("--uri", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    policy, value = build(seed=0)
    policy_opt = torch.optim.AdamW(policy.parameters(), lr=1e-2, weight_decay=0.1)
    value_opt = torch.optim.AdamW(value.parameters(), lr=3e-2)
    app_state = {"policy": ModelState(policy, policy_opt), "value": ModelState(value, value_opt)}

    data = torch.Generator().manual_seed(1234)  # fixed data, the same in both jobs
    inputs = torch.randn(args.steps + 2, world, BATCH, FEATURES, generator=data)
    targets = torch.randn(args.steps + 2, world, BATCH, 1, generator=data)
    torch.manual_seed(100 + rank)  # per-rank stream for dropout and input noise

    def step(i: int) -> list[float]:
        x = inputs[i, rank] + 0.05 * torch.randn(BATCH, FEATURES)
        policy_loss = nn.functional.mse_loss(policy(x), targets[i, rank])
        value_loss = nn.functional.mse_loss(value(x), targets[i, rank])
        (policy_loss + value_loss).backward()
        for opt in (policy_opt, value_opt):
            opt.step()
            opt.zero_grad()
        return [policy_loss.item(), value_loss.item()]

    store = CheckpointStore(open_location(args.uri))
    mismatch_error = ""
    if args.phase == "save":
        for i in range(args.steps):
            step(i)
        state = LearnerState(
            step=args.steps,
            policy_version=args.steps // 2,
            stream_cursor={"next_seq": 3 * args.steps, "epoch": 0},
            extra={"data_seed": 1234},
        )
        store.save(app_state, state)
    else:
        latest = store.latest_committed()
        if latest != args.steps:
            raise SystemExit(f"rank {rank}: latest_committed() is {latest}, not {args.steps}")
        state = store.load(latest, app_state)
        try:  # every rank must get the same error, and nothing may be written
            store.save(app_state, LearnerState(step=99, policy_version=0, extra={"rank": rank}))
        except StorageError as exc:
            mismatch_error = str(exc)
        if store.committed_steps() != [latest]:
            raise SystemExit(f"rank {rank}: committed steps {store.committed_steps()}")
    following = [step(args.steps), step(args.steps + 1)]
    record = {
        "rank": rank,
        "following": following,
        "learner": dataclasses.asdict(state),
        "mismatch_error": mismatch_error,
    }
    (Path(args.out) / f"{args.phase}-rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_process(0)  # no interpreter teardown for gloo's threads to race
