"""One rank of the sharded-publish test (run by torchrun from test_weight_publisher.py, or in
the test's own process as the only rank).

    torchrun --nproc_per_node 2 publish_worker.py --out DIR

Shards the tiny policy with FSDP2 and publishes it through `WeightPublisher` in bf16 as
version 1 (full), then version 2 after a seeded change of a few elements of every parameter
(a delta against 1), then version 3 after a change of every element (too large for a delta:
full). The changes are made to the full weights and loaded into the shards, so every world
size publishes the same values. With `STREAMRL_WEIGHT_HANDOFF=1` each rank also leaves its
shard of every version in its hand-off slots (kept after the job: the test reads them).
"""

from __future__ import annotations

import argparse

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from storage.fs import open_location
from storage.weights.publish import WeightWriter
from streamrl.learner.config import WeightsConfig
from streamrl.learner.model import load_policy, shard_model
from streamrl.learner.publish import WeightPublisher
from streamrl.learner.topology import Topology, exit_process
from streamrl.models.config import ModelConfig
from streamrl.placement.handoff import HandOffWriter

MODEL = "tiny-qwen2"
MODEL_CFG = ModelConfig(path=MODEL, dtype="bfloat16")
WEIGHTS = WeightsConfig(full_every=4, background=True, shard_bytes=64 * 1024)


def changed(state: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """`state` with a seeded `fraction` of every tensor's elements moved by 1 %."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in state.items():
        hit = torch.rand(tensor.shape, generator=generator) < fraction
        out[name] = torch.where(hit, tensor * 1.01 + 1e-3, tensor)
    return out


def publish_versions(
    run_dir: str, topology: Topology, weights: WeightsConfig = WEIGHTS, last_fraction: float = 1.0
) -> list[dict[str, float]]:
    """Versions 1-3 as the module docstring says (version 3 changes `last_fraction` of the
    elements); each publish's metrics (rank 0's last is that of the final flush)."""
    policy = load_policy(MODEL, MODEL_CFG)
    original = {k: v.clone() for k, v in policy.state_dict().items()}
    shard_model(policy, topology, mixed_precision="fp32", activation_checkpointing=True)
    run = open_location(run_dir)
    handoff = HandOffWriter.if_placed(run.uri, topology.rank, topology.world_size, topology.device)
    store = WeightWriter(run)
    publisher = WeightPublisher(store, topology, weights, torch.bfloat16, handoff=handoff)
    metrics = [publisher.publish(policy, 1)]
    for version, (fraction, seed) in ((2, (0.01, 1)), (3, (last_fraction, 2))):
        update = changed(original, fraction, seed)
        set_model_state_dict(policy, update, options=StateDictOptions(full_state_dict=True))
        metrics.append(publisher.publish(policy, version))
    publisher.flush()
    return metrics


def land_then_fail(version: int) -> None:
    """On this rank, writing `version`'s share lands and then raises (as a request that timed
    out after the server stored it), and recording the failure fails too: rank 0 commits the
    version from the share that landed, while this rank saw only errors."""
    write_share = WeightWriter.write_share

    def landed_but_raised(self, v, *args, **kwargs):
        part = write_share(self, v, *args, **kwargs)
        if v == version:
            raise TimeoutError(f"injected: the response to v{v}'s share was lost")
        return part

    def unrecorded(self, *args, **kwargs):
        raise TimeoutError("injected: storage unreachable")

    WeightWriter.write_share = landed_but_raised
    WeightWriter.abandon_share = unrecorded


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--land-then-fail", action="store_true", help="rank 1's share of v2: see land_then_fail"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    with Topology.from_env("cpu") as topology:
        if not args.land_then_fail:
            publish_versions(args.out, topology)
            return
        if topology.rank == 1:
            land_then_fail(2)
        once = WEIGHTS.model_copy(update={"publish_attempts": 1})
        publish_versions(args.out, topology, once, last_fraction=0.01)  # v3: a delta on v2


if __name__ == "__main__":
    main()
    exit_process(0)  # no interpreter teardown for gloo's threads to race
