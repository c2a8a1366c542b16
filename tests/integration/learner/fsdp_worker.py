"""One rank of the two-rank FSDP2 learner test (run by torchrun from test_fsdp.py).

    torchrun --nproc_per_node 2 fsdp_worker.py --out DIR

Loads the tiny policy, shards it (activation checkpointing on) and takes `STEPS` AdamW steps
on a fixed batch, each rank on its half of the rows with the loss divided by the token count
of the whole batch, with warm-up, cosine decay and clipping. Then it gathers the full state
dict and runs the critic, sharded, on its half of the batch. Writes `<out>/rank<r>.json`
(losses summed over ranks, gradient norms, lrs, values) and, on rank 0, `<out>/state.pt`.
The test repeats all of it in one process without sharding and compares.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import Tensor, nn

from streamrl.learner.model import full_state_dict, load_policy, load_value_model, shard_model
from streamrl.learner.optim import build_optimizer, build_scheduler, clip_grad_norm
from streamrl.learner.topology import Topology, exit_process
from streamrl.models.config import CriticConfig, ModelConfig

MODEL = "tiny-qwen2"
MODEL_CFG = ModelConfig(path=MODEL, dtype="float32", critic=CriticConfig(init_from="policy"))
ROWS, SEQ_LEN, STEPS = 4, 12, 2
OPTIM = {"lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8}
SCHEDULE = {"warmup_steps": 1, "total_steps": STEPS, "schedule": "cosine", "min_lr_ratio": 0.1}
MAX_NORM = 0.5  # below the tiny model's gradient norm, so clipping acts


def fixed_batch(vocab_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """input_ids [ROWS, SEQ_LEN] int64, attention_mask and loss_mask [ROWS, SEQ_LEN] float32:
    right-padded rows of different lengths; the loss covers each row's tokens after the 4th."""
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, vocab_size, (ROWS, SEQ_LEN), generator=generator)
    lengths = torch.tensor([12, 9, 11, 7])
    positions = torch.arange(SEQ_LEN)
    attention_mask = (positions < lengths[:, None]).float()
    loss_mask = attention_mask * (positions >= 4).float()
    return input_ids, attention_mask, loss_mask


def summed_token_nll(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, loss_mask: Tensor
) -> Tensor:
    """Σ over rows and masked positions t ≥ 1 of −log p(token_t | tokens_<t): a scalar."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # [b, T, V]
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    token_logp = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [b, T-1]
    return -(token_logp * loss_mask[:, 1:]).sum()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)

    topology = Topology.from_env("cpu")
    rank, world = topology.rank, topology.world_size
    policy = load_policy(MODEL, MODEL_CFG)
    input_ids, attention_mask, loss_mask = fixed_batch(policy.config.vocab_size)
    total_tokens = loss_mask[:, 1:].sum()  # the denominator: tokens of the whole batch
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)

    shard_model(policy, topology, mixed_precision="auto", activation_checkpointing=True)
    tied = policy.lm_head.weight is policy.model.embed_tokens.weight
    optimizer = build_optimizer(policy.parameters(), **OPTIM)
    scheduler = build_scheduler(optimizer, **SCHEDULE)
    record: dict[str, list] = {"loss": [], "grad_norm": [], "lr": []}
    for _ in range(STEPS):
        local = (
            summed_token_nll(policy, input_ids[rows], attention_mask[rows], loss_mask[rows])
            / total_tokens
        )
        local.backward()
        record["grad_norm"].append(clip_grad_norm(policy, MAX_NORM))
        record["lr"].append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        record["loss"].append(topology.all_reduce_sum(local.detach()).item())

    state = full_state_dict(policy, topology)
    topology.main_only(lambda: torch.save(state, Path(args.out) / "state.pt"))

    critic = shard_model(load_value_model(MODEL, MODEL_CFG, seed=0), topology)
    with torch.no_grad():
        values = critic(input_ids[rows], attention_mask=attention_mask[rows])  # [b, T]
    result = {"rank": rank, "tied": tied, "values": values.tolist(), **record}
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(result))
    topology.destroy()


if __name__ == "__main__":
    main()
    exit_process(0)  # no interpreter teardown for gloo's threads to race
