"""Checkpoint save and resume verification for the demo model, on SeaweedFS (issue 42).

    .venv/bin/python -m benchmarks.checkpoint_bench [--model smollm2-135m-instruct] [--repeats 3]
        [--backends seaweedfs local]

The state is what the learner saves for the demo (DAPO, no critic): the fp32 policy, FSDP2-
sharded over one gloo rank, with its AdamW moments after one update, as `ModelState` in
`CheckpointStore.save`. Each repeat times, on the same state:

- `save`: `CheckpointStore.save` as it is: DCP writes through `HashingWriter` (every file hashed
  on the way out), learner state, one listing, COMMITTED. Nothing is read back.
- `dcp_write`: `dcp.save` through torch's plain `FsspecWriter` into another folder: the write
  alone, without hashing (the two writes alternate in order; their difference is the cost of
  hashing in the stream plus the few small objects, and within the noise of a shared machine).
- `read_back`: `hash_share` over the files of the checkpoint `save` wrote: the pass the old save
  made after the write (every file downloaded and hashed) to fill COMMITTED.
- `verify`: a fresh store's `latest_verified()`: what a resume checks, before and after.

`stream_hash_s`: xxh3-128 of as many bytes in memory (256 MiB hashed, scaled), what hashing on
the way out adds to the writing thread. The old save did everything the new one does but hash
in the stream, plus the read-back: `before_s` = save - stream_hash + read_back, from figures of
the same run; `before_vs_after` = before / save. Every figure is the fastest of `--repeats`
(the least disturbed on a shared 2-core machine).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import uuid
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

from benchmarks.storage_bench import markdown_table
from storage.checkpoints.dcp import CheckpointStore, LearnerState, ModelState, step_dirname
from storage.checkpoints.ranks import hash_share
from storage.checkpoints.record import COMMITTED, CommittedRecord
from storage.fs import Location, open_location
from storage.seaweedfs import SeaweedFS
from streamrl.learner.model import load_policy, shard_model
from streamrl.learner.optim import build_optimizer
from streamrl.learner.topology import Topology
from streamrl.models.config import ModelConfig

MB = 1e6


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def demo_state(model: str, topology: Topology) -> dict[str, ModelState]:
    """The policy and its AdamW state after one update, as the learner checkpoints them."""
    policy = shard_model(
        load_policy(model, ModelConfig(path=model, dtype="float32")),
        topology,
        mixed_precision="fp32",
    )
    optimizer = build_optimizer(policy.parameters(), lr=1e-6, weight_decay=0.0)
    batch = torch.randint(0, policy.config.vocab_size, (2, 32), generator=torch.Generator())
    logits = policy(input_ids=batch).logits
    logp = logits[:, :-1].log_softmax(-1).gather(-1, batch[:, 1:].unsqueeze(-1))
    (-logp.mean()).backward()  # divided by every predicted token of the batch
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"policy": ModelState(policy, optimizer)}


def bench_backend(name: str, run: Location, app_state: dict, repeats: int) -> dict:
    store = CheckpointStore(run)
    times: dict[str, list[float]] = {"save": [], "dcp_write": [], "read_back": [], "verify": []}
    stored = 0

    def save(step: int) -> None:
        times["save"].append(
            _timed(lambda: store.save(app_state, LearnerState(step=step, policy_version=step)))
        )

    def dcp_write(plain: Location) -> None:
        writer = FsspecWriter(plain.uri, sync_files=plain.is_local, **plain.storage_options())
        times["dcp_write"].append(_timed(lambda: dcp.save(app_state, storage_writer=writer)))

    for step in range(1, repeats + 1):
        plain = run.child("plain", uuid.uuid4().hex[:8])
        if step % 2:  # alternate which write comes first: neither gets a warmer server
            save(step)
            dcp_write(plain)
        else:
            dcp_write(plain)
            save(step)
        folder = run.child("checkpoints", step_dirname(step))
        record = CommittedRecord.from_json(folder.fs.cat_file(folder.join(COMMITTED)), folder.uri)
        stored = sum(check.size for check in record.files.values())
        names = sorted(record.files)
        times["read_back"].append(_timed(lambda: hash_share(folder, names)))  # noqa: B023
        times["verify"].append(_timed(lambda: CheckpointStore(run).latest_verified()))
        store.retain(keep=1)  # bounded disk use
        plain.fs.rm(plain.path, recursive=True)
        print(name, {key: round(values[-1], 3) for key, values in times.items()}, flush=True)
    best = {key: min(values) for key, values in times.items()}
    stream_hash = stored / hash_bytes_per_s()
    before = best["save"] - stream_hash + best["read_back"]
    return {
        "backend": name,
        "checkpoint_MB": stored / MB,
        "save_s": best["save"],
        "dcp_write_s": best["dcp_write"],
        "stream_hash_s": stream_hash,
        "read_back_s": best["read_back"],
        "before_s": before,
        "before_vs_after": before / best["save"],
        "verify_s": best["verify"],
        "verify_MB_s": stored / MB / best["verify"],
    }


def hash_bytes_per_s(mib: int = 256) -> float:
    """xxh3-128 throughput over bytes in memory, fastest of three."""
    data = torch.randint(0, 256, (mib << 20,), dtype=torch.uint8).numpy()
    return data.nbytes / min(_timed(lambda: xxhash.xxh3_128_hexdigest(data)) for _ in range(3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=3, help="saves per backend")
    parser.add_argument("--backends", nargs="+", default=["seaweedfs"])
    args = parser.parse_args()

    with Topology.from_env("cpu") as topology:
        app_state = demo_state(args.model, topology)
        rows = []
        with tempfile.TemporaryDirectory() as tmp, SeaweedFS() as server:
            for name in args.backends:
                run = (
                    open_location(
                        f"s3://{server.bucket}/bench-{uuid.uuid4().hex[:8]}",
                        storage_options=server.storage_options,
                    )
                    if name == "seaweedfs"
                    else open_location(os.path.join(tmp, "run"))
                )
                rows.append(bench_backend(name, run, app_state, args.repeats))
                print(markdown_table(rows[-1:]), flush=True)
    print(f"## Checkpoint save and verify: {args.model}, best of {args.repeats}")
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
