"""One rank of the meta-device loading test (run by torchrun from test_meta_loading.py; the
test also calls `compare` in its own process, as a one-rank job).

    torchrun --nproc_per_node 2 meta_loading_worker.py --models DIR --out DIR

For each case of `cases(DIR)` it loads the model both ways: as before (`load_policy` /
`load_value_model` whole on every rank, then `shard_model`) and from the meta device
(`load_sharded`). It compares the full state dicts gathered on rank 0 bitwise, the buffers,
and a forward pass on a fixed batch, and records which rows of each checkpoint tensor this
rank read. Writes `<out>/rank<r>.json`: {case: comparison}.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from streamrl.learner.forward import use_hidden_states_head
from streamrl.learner.meta import (
    SafetensorsCheckpoint,
    load_sharded,
    meta_policy,
    meta_value_model,
)
from streamrl.learner.model import full_state_dict, load_policy, load_value_model, shard_model
from streamrl.learner.topology import Topology, exit_process
from streamrl.models.config import CriticConfig, ModelConfig

SEED = 3  # the critic's fresh head


def cases(models: Path) -> dict[str, tuple[str, ModelConfig]]:
    """Case name → (policy or critic, model config). `models` holds what the test saved:
    `split` (an untied causal LM over two safetensors files, bf16, odd vocabulary) and `rm`
    (a one-label reward model over tiny-qwen2's vocabulary). tiny-qwen2 ties its embeddings."""
    tiny = ModelConfig(path="tiny-qwen2", critic=CriticConfig(init_from="policy"))
    reward = ModelConfig(path="tiny-qwen2", critic=CriticConfig(init_from=str(models / "rm")))
    return {
        "tied policy": ("policy", tiny),
        "split policy": ("policy", ModelConfig(path=str(models / "split"))),
        "critic from policy": ("critic", tiny),
        "critic from reward model": ("critic", reward),
    }


@contextmanager
def recorded_reads() -> Iterator[list[list]]:
    """Every `SafetensorsCheckpoint.read` within: [name, first row, end row, rows in all]
    (first and end None for a whole read)."""
    reads: list[list] = []
    read = SafetensorsCheckpoint.read

    def recording(self: SafetensorsCheckpoint, name: str, rows: slice | None = None):
        bounds = [None, None] if rows is None else [rows.start, rows.stop]
        reads.append([name, *bounds, self.shape(name)[0]])
        return read(self, name, rows)

    SafetensorsCheckpoint.read = recording
    try:
        yield reads
    finally:
        SafetensorsCheckpoint.read = read


def compare(kind: str, model_cfg: ModelConfig, topology: Topology) -> dict:
    """Load one model both ways and compare. `mismatched`: parameters that differ (or exist
    on one side only) in the full state dicts, None off the main rank."""
    path = model_cfg.path
    if kind == "policy":

        def shard(model: nn.Module) -> nn.Module:
            lm = use_hidden_states_head(model)
            return shard_model(lm, topology, activation_checkpointing=True)

        before = shard(load_policy(path, model_cfg))
        with recorded_reads() as reads:
            after = load_sharded(meta_policy(path, model_cfg), shard, topology)
    else:

        def shard(model: nn.Module) -> nn.Module:
            return shard_model(model, topology)

        before = shard(load_value_model(path, model_cfg, seed=SEED))
        with recorded_reads() as reads:
            after = load_sharded(meta_value_model(path, model_cfg, seed=SEED), shard, topology)

    expected, got = full_state_dict(before, topology), full_state_dict(after, topology)
    mismatched = None
    if topology.is_main:
        mismatched = sorted(set(expected) ^ set(got)) + [
            name for name in expected if name in got and not torch.equal(expected[name], got[name])
        ]
    buffers_before, buffers_after = dict(before.named_buffers()), dict(after.named_buffers())
    vocab = getattr(before, "backbone", before).config.vocab_size
    input_ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        outputs = [model(input_ids=input_ids) for model in (before, after)]
    if kind == "policy":
        outputs = [output.logits for output in outputs]  # the final hidden states
    return {
        "mismatched": mismatched,
        "buffers": sorted(buffers_after) == sorted(buffers_before)
        and all(torch.equal(buffers_after[n], b) for n, b in buffers_before.items()),
        "rotary": any("inv_freq" in name for name in buffers_after),
        "forward": torch.equal(outputs[0], outputs[1]),
        "dtypes": sorted({str(p.dtype) for p in after.parameters()}),
        "reads": reads,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)

    topology = Topology.from_env("cpu")
    results = {
        name: compare(kind, model_cfg, topology)
        for name, (kind, model_cfg) in cases(Path(args.models)).items()
    }
    (Path(args.out) / f"rank{topology.rank}.json").write_text(json.dumps(results))
    topology.destroy()


if __name__ == "__main__":
    main()
    exit_process(0)  # no interpreter teardown for gloo's threads to race
