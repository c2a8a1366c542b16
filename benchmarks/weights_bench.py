"""The weight path end to end: publishing from 1 and 2 learner ranks against raw fsspec writes
of the same bytes, the training time a publish costs, delta versus full versions after real
AdamW steps, and loading versions into a vLLM engine; plus the checksum's speed.

    .venv/bin/python -m benchmarks.weights_bench                      # every phase, 0.5B shape
    .venv/bin/python -m benchmarks.weights_bench --model tiny-qwen2   # smoke run
    .venv/bin/python -m benchmarks.weights_bench --phases publish --backends local

Phases (`--phases`), each in processes of its own so that their memory peaks do not mix:

- *hash*: sha256 against xxh3-128 (the store's checksum) over the same bytes, GB/s.
- *publish*: `--ranks` learner ranks (gloo, spawned processes) each hold an FSDP2 shard of
  the fp32 model and publish it through `WeightPublisher` as a full version in fp32 and in
  bf16, on a local folder and on SeaweedFS (a real S3 server on 127.0.0.1, sharing the 2
  cores). Time = the `publish` call + `flush` on rank 0 until the version is committed. Raw =
  every rank `fs.pipe`s files of exactly the sizes and bytes it wrote, in ~1 GiB rounds as the
  store does, concurrently (barrier to barrier). Rank 0 then loads the version
  (`WeightFollower`, verified) against a raw `fs.cat` of its files. With one rank, where the
  write's time goes (snapshot, finiteness checks, piece checksums, safetensors serialisation,
  file checksums, write).
- *step*: forward + backward + AdamW on a fixed batch (`--batch` rows × `--seq` tokens) of
  the FSDP2 model, `--steps` steps without publishing, then `--steps` steps each followed by
  `WeightPublisher.publish` (bf16, background upload, deltas as configured by default).
- *delta*: after real AdamW steps at each `--lrs` (fp32 master weights, bf16 published),
  each version written by the store both as a delta against the previous version and full:
  bytes, seconds (`write_share` + `commit`), elements changed, the compare's cost, and the
  generator-side build (`WeightFollower.advance`: delta applied in place onto the held
  version vs the full version built); the rebuilt weights must equal the full ones bit for bit.
- *load*: `Engine.advance_weights` of a full version, then of a delta (`--load-delta`
  of the elements changed), against a raw `fs.cat` of the same files, per backend.

Figures are printed next to the goals: publish and load ≥ 0.8× raw storage throughput,
training time lost ≤ 5 % of a step, delta ≤ 10 % of a full version's bytes at lr 1e-6.
No timing is asserted.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import safetensors.torch
import torch
import xxhash
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from benchmarks.storage_bench import markdown_table
from storage.fs import Location, open_location
from storage.seaweedfs import SeaweedFS
from storage.weights.follower import WeightFollower
from storage.weights.manifest import checksum
from storage.weights.pieces import encode_share
from storage.weights.publish import WeightWriter
from storage.weights.shares import TensorShare, check_finite, new_publish_id
from storage.weights.versions import WeightStore
from streamrl.learner.config import WeightsConfig
from streamrl.learner.model import load_policy, shard_model
from streamrl.learner.optim import build_optimizer
from streamrl.learner.publish import WeightPublisher, local_shares
from streamrl.learner.topology import Topology
from streamrl.models.config import ModelConfig

MB = 1e6
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # short name → `weights.dtype`
GOAL_RAW, GOAL_LOST, GOAL_DELTA = 0.8, 0.05, 0.10


def _timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, Any]:
    """(seconds, result) of `fn(*args, **kwargs)`."""
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - start, out


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _file(store: WeightStore, version: int, name: str) -> str:
    return store.root.join(f"v{version:08d}", name)


def _policy(model: str, topology: Topology) -> torch.nn.Module:
    """The fp32 master model, FSDP2-sharded over `topology` (fp32 compute on CPU)."""
    policy = load_policy(model, ModelConfig(path=model, dtype="float32"))
    return shard_model(policy, topology, mixed_precision="fp32")


def _in_processes(target: Callable, world: int, *args: Any) -> dict:
    """`target(rank, world, *args, results)` on `world` spawned ranks; rank 0's result."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [
        ctx.Process(target=_rank_main, args=(target, rank, world, port, args, results))
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    if any(proc.exitcode != 0 for proc in procs):
        raise RuntimeError(f"{target.__name__} failed: exit codes {[p.exitcode for p in procs]}")
    return results.get(timeout=5)


def _rank_main(target: Callable, rank: int, world: int, port: int, args: tuple, results) -> None:
    os.environ |= {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    with Topology.from_env("cpu") as topology:
        out = target(topology, *args)
        if topology.is_main:
            results.put(out)


# -- hash --------------------------------------------------------------------------------------


def bench_hash(mib: int) -> dict:
    data = torch.randint(0, 256, (mib * 1024**2,), dtype=torch.uint8).numpy()
    sha = min(_timed(lambda: hashlib.sha256(data).hexdigest())[0] for _ in range(3))
    xxh = min(_timed(lambda: xxhash.xxh3_128_hexdigest(data))[0] for _ in range(3))
    return {
        "MiB": mib,
        "sha256_GB_s": data.nbytes / 1e9 / sha,
        "xxh3_128_GB_s": data.nbytes / 1e9 / xxh,
        "xxh3_vs_sha256": sha / xxh,
    }


# -- publish (every rank) ----------------------------------------------------------------------


def _publish_rank(topology: Topology, model: str, locations: list, repeats: int) -> list[dict]:
    """Every (backend, dtype): `repeats` full versions through the publisher, the raw write of
    the same files, then (rank 0) the verified load against a raw read."""
    policy = _policy(model, topology)
    rows = []
    for backend, uri, options in locations:
        for dtype_name in DTYPES:
            run = open_location(
                f"{uri}/w{topology.world_size}-{dtype_name}", storage_options=options
            )
            rows.append(_publish_case(topology, policy, run, backend, dtype_name, repeats))
            gc.collect()
    return rows


def _publish_case(topology, policy, run: Location, backend, dtype_name, repeats) -> dict:
    store = WeightStore(run)
    config = WeightsConfig(dtype=DTYPES[dtype_name], full_every=1, keep_versions=2)
    dtype = getattr(torch, DTYPES[dtype_name])
    publisher = WeightPublisher(WeightWriter(run), topology, config, dtype)
    publish_s, sync_s = [], []
    for version in range(1, repeats + 1):
        topology.barrier()
        start = time.perf_counter()
        metrics = publisher.publish(policy, version)
        publisher.flush()  # rank 0: until the version is committed
        publish_s.append(time.perf_counter() - start)
        sync_s.append(metrics["perf/weight_sync_s"])
    topology.barrier()  # ranks ≠ 0 return from flush before rank 0 commits
    del publisher
    gc.collect()
    profile = _profile_write(store, policy, dtype) if topology.world_size == 1 else {}
    gc.collect()
    manifest = store.read_manifest(repeats)
    mine = [f.file for f in manifest.files if f"-r{topology.rank:05d}-" in f.file]
    payload = {
        run.join("raw", f"x{i}", file): store.fs.cat_file(_file(store, repeats, file))
        for i in range(repeats)
        for file in mine
    }
    if run.is_local:
        for i in range(repeats):
            run.fs.makedirs(run.join("raw", f"x{i}"), exist_ok=True)
    raw_put_s = []
    for i in range(repeats):
        topology.barrier()
        start = time.perf_counter()
        _pipe_in_rounds(run.fs, {p: d for p, d in payload.items() if f"/x{i}/" in p})
        topology.barrier()
        raw_put_s.append(time.perf_counter() - start)
    del payload
    row: dict[str, Any] = {}
    if topology.is_main:
        load_s, raw_get_s = [], []
        paths = [_file(store, repeats, f.file) for f in manifest.files]
        for _ in range(repeats):
            follower = WeightFollower(store, hold=False)
            load_s.append(_timed(follower.advance, exactly=repeats)[0])
            del follower
            raw_get_s.append(_timed(run.fs.cat, paths)[0])
            gc.collect()
        stored = manifest.stored_bytes
        row = {
            "ranks": topology.world_size,
            "backend": backend,
            "dtype": dtype_name,
            "MB": stored / MB,
            "files": len(manifest.files),
            "publish_s": min(publish_s),
            "publish_mean_s": statistics.mean(publish_s),
            "on_training_path_s": statistics.mean(sync_s),
            "raw_put_s": min(raw_put_s),
            "publish_vs_raw": min(raw_put_s) / min(publish_s),
            "load_s": min(load_s),
            "raw_get_s": min(raw_get_s),
            "load_vs_raw": min(raw_get_s) / min(load_s),
        }
        if profile:
            row["profile"] = profile
        print(f"publish case done: {row}", flush=True)  # kept if a later case fails
    topology.barrier()
    return row


def _profile_write(store: WeightStore, policy: torch.nn.Module, dtype: torch.dtype) -> dict:
    """Where one rank's full version spends its time, step by step: the publisher's snapshot
    (state dict, finiteness, copy + cast), then the steps `WeightWriter.write_share` runs."""
    out: dict[str, float] = {}
    out["state dict (local_shares)"], local = _timed(lambda: local_shares(policy, True))
    floats = [t for t, _, _ in local.values() if t.is_floating_point() and t.numel()]
    out["isfinite (publisher)"] = _timed(
        lambda: torch.stack([torch.isfinite(t).all() for t in floats]).tolist()
    )[0]
    out["copy + cast"], shares = _timed(
        lambda: {
            n: TensorShare(t.detach().reshape(-1).to(dtype).clone(), start, shape)
            for n, (t, start, shape) in local.items()
        }
    )
    out["check_finite (store)"] = _timed(
        lambda: check_finite(1, {n: s.data for n, s in shares.items()})
    )[0]
    out["piece checksums (encode_share)"], encoded = _timed(lambda: encode_share(shares))
    files, current, size = [], {}, 0
    for key, tensor in encoded.entries.items():  # files of at most shard_bytes, as the store
        if current and size + tensor.nbytes > WeightsConfig().shard_bytes:
            files.append(current)
            current, size = {}, 0
        current[key], size = tensor, size + tensor.nbytes
    files.append(current)
    out["safetensors serialise"], blobs = _timed(
        lambda: [safetensors.torch.save(entries) for entries in files]
    )
    out["file checksums"] = _timed(lambda: [checksum(b) for b in blobs])[0]
    folder = store.root.join("profile")
    if store.root.is_local:
        store.fs.makedirs(folder, exist_ok=True)
    out["write (fs.pipe)"] = _timed(
        _pipe_in_rounds, store.fs, {f"{folder}/{i}.safetensors": b for i, b in enumerate(blobs)}
    )[0]
    return out


def _pipe_in_rounds(fs: Any, objects: dict[str, bytes]) -> None:
    """`fs.pipe` of about 1 GiB at a time (concurrent PUTs within a round), as the store
    writes: one pipe of a whole fp32 version makes SeaweedFS on this box fail uploads."""
    batch: dict[str, bytes] = {}
    for path, data in objects.items():
        if batch and sum(map(len, batch.values())) + len(data) > 1024**3:
            fs.pipe(batch)
            batch = {}
        batch[path] = data
    if batch:
        fs.pipe(batch)


# -- training step with and without publishing ---------------------------------------------


def _step_rank(topology: Topology, model: str, run_uri: str, options: dict, args: dict) -> dict:
    policy = _policy(model, topology)
    optimizer = build_optimizer(policy.parameters(), args["lr"], weight_decay=0.0)
    vocab = policy.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, vocab, (args["batch"], args["seq"]), generator=generator)

    def train() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = policy(input_ids=batch).logits
        logp = logits[:, :-1].log_softmax(-1).gather(-1, batch[:, 1:].unsqueeze(-1))
        (-logp.mean()).backward()  # divided by every predicted token of the batch
        optimizer.step()

    writer = WeightWriter(open_location(run_uri, storage_options=options))
    store = writer.reader
    publisher = WeightPublisher(writer, topology, WeightsConfig(dtype="bfloat16"), torch.bfloat16)
    for _ in range(args["warmup"]):
        train()
    publisher.publish(policy, 1)  # allocates the snapshot buffers
    publisher.flush()
    bare = [_timed(train)[0] for _ in range(args["steps"])]
    with_publish, sync, uploads = [], [], []
    for version in range(2, args["steps"] + 2):
        start = time.perf_counter()
        train()
        metrics = publisher.publish(policy, version)
        with_publish.append(time.perf_counter() - start)
        sync.append(metrics["perf/weight_sync_s"])
        if "perf/weight_upload_s" in metrics:
            uploads.append((metrics["perf/weight_upload_s"], metrics["weights/full"]))
    flush_s, last = _timed(publisher.flush)
    return {
        "bare": bare,
        "with": with_publish,
        "sync": sync,
        "uploads": uploads,
        "flush_s": flush_s,
        "last_upload_s": last.upload_s if last else float("nan"),
        "versions": store.versions(),
        "full": [v for v in store.versions() if store.read_manifest(v).is_full],
    }


# -- delta vs full -----------------------------------------------------------------------------


def _bf16_state(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The published view of the model: every tensor in bf16, whole (one rank)."""
    return {
        name: (value.full_tensor() if hasattr(value, "full_tensor") else value)
        .detach()
        .to(torch.bfloat16)
        .reshape(-1)
        .clone()
        for name, value in get_model_state_dict(policy).items()
    }


def _delta_rank(topology: Topology, model: str, run_uri: str, options: dict, args: dict) -> list:
    rows = []
    for lr in args["lrs"]:
        policy = _policy(model, topology)
        shapes = {n: tuple(v.shape) for n, v in get_model_state_dict(policy).items()}
        optimizer = build_optimizer(policy.parameters(), lr, weight_decay=0.0)
        batch = torch.randint(
            0,
            policy.config.vocab_size,
            (args["batch"], args["seq"]),
            generator=torch.Generator().manual_seed(0),
        )
        run = open_location(f"{run_uri}/lr{lr:g}-{uuid.uuid4().hex[:6]}", storage_options=options)
        stores = {kind: WeightWriter(run.child(kind)) for kind in ("delta", "full")}
        previous = _bf16_state(policy)
        for store in stores.values():
            _write(store, 1, previous, shapes, None)
        holder = WeightFollower(stores["delta"].reader, hold=True)
        first_build_s = _timed(holder.advance, exactly=1)[0]
        for version in range(2, args["steps"] + 2):
            optimizer.zero_grad(set_to_none=True)
            logits = policy(input_ids=batch).logits
            logp = logits[:, :-1].log_softmax(-1).gather(-1, batch[:, 1:].unsqueeze(-1))
            (-logp.mean()).backward()
            optimizer.step()
            current = _bf16_state(policy)
            changed = sum(
                int(torch.ne(current[n].view(torch.int16), previous[n].view(torch.int16)).sum())
                for n in current
            )
            numel = sum(t.numel() for t in current.values())
            shares = {n: _share(current, shapes, n) for n in current}
            compare_s = _timed(encode_share, shares, previous, max_delta_ratio=1.0)[0]
            encode_full_s = _timed(encode_share, shares)[0]
            delta_s, delta = _timed(_write, stores["delta"], version, current, shapes, previous)
            full_s, full = _timed(_write, stores["full"], version, current, shapes, None)
            apply_s = _timed(holder.advance, exactly=version)[0]
            fresh = WeightFollower(stores["full"].reader, hold=False)
            build_s = _timed(fresh.advance, exactly=version)[0]
            rebuilt, whole = holder.tensors(), fresh.tensors()
            for name in current:  # correctness, not timing: the delta path is exact
                expected = current[name].view(torch.int16)
                assert torch.equal(rebuilt[name].reshape(-1).view(torch.int16), expected), name
                assert torch.equal(whole[name].reshape(-1).view(torch.int16), expected), name
            assert delta.base == version - 1, f"v{version} was not stored as a delta"
            rows.append(
                {
                    "lr": lr,
                    "version": version,
                    "changed_frac": changed / numel,
                    "full_MB": full.stored_bytes / MB,
                    "delta_MB": delta.stored_bytes / MB,
                    "delta_vs_full": delta.stored_bytes / full.stored_bytes,
                    "full_write_s": full_s,
                    "delta_write_s": delta_s,
                    "delta_compare_s": compare_s,
                    "full_encode_s": encode_full_s,
                    "gen_full_build_s": build_s,
                    "gen_delta_apply_s": apply_s,
                    "first_build_s": first_build_s,
                }
            )
            del whole, rebuilt, shares
            previous = current
            gc.collect()
        del policy, optimizer, previous
        gc.collect()
    return rows


def _share(state: dict[str, torch.Tensor], shapes: dict, name: str) -> TensorShare:
    return TensorShare(state[name], 0, shapes[name])


def _write(store: WeightWriter, version: int, state: dict, shapes: dict, base: dict | None):
    """What the publisher's upload thread does for one rank: `write_share` + `commit`."""
    publish_id = new_publish_id()
    shares = {n: _share(state, shapes, n) for n in state}
    store.write_share(
        version,
        shares,
        publish_id=publish_id,
        rank=0,
        world=1,
        base=None if base is None else (version - 1, base),
        max_delta_ratio=1.0,
    )
    return store.commit(version, publish_id=publish_id, world=1)


# -- loading into a vLLM engine ------------------------------------------------------------------


def _changed(tensor: torch.Tensor, fraction: float) -> torch.Tensor:
    """A copy with every (1/fraction)-th element nudged (tied tensors stay equal)."""
    out = tensor.clone()
    out.view(-1)[:: max(1, round(1 / fraction))] += 1e-2
    return out


def _load_main(model: str, locations: list, fraction: float, repeats: int, results) -> None:
    from transformers import AutoModelForCausalLM

    from streamrl.config.loading import load_config
    from streamrl.generator.engine import Engine
    from streamrl.generator.weight_worker import WeightSource
    from streamrl.models import resolve_model_path

    config = load_config(
        ["dapo", "tiny-cpu"],
        overrides=[f"model.path={model}", "model.dtype=bfloat16", "generator.cpu_kv_cache_gib=1"],
    )
    path = resolve_model_path(model)
    engine = Engine(path, config.model, config.generator, seed=0)
    engine.generate([[1, 2, 3]])  # warm-up
    state = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).state_dict()
    nudged = {name: _changed(tensor, fraction) for name, tensor in state.items()}
    rows = []
    for backend, uri, options in locations:
        run = open_location(f"{uri}/load-{uuid.uuid4().hex[:6]}", storage_options=options)
        writer = WeightWriter(run)
        store = writer.reader
        writer.publish(1, state)
        writer.publish(2, nudged, base=(1, state))
        source = WeightSource(run.uri, run.storage_options(), hold=True)
        full_s, delta_s, raw_full_s, raw_delta_s = [], [], [], []
        for _ in range(repeats):
            full_s.append(engine.advance_weights(source, exactly=1)[1])  # built whole
            delta_s.append(engine.advance_weights(source, exactly=2)[1])  # onto the held v1
            for version, raw in ((1, raw_full_s), (2, raw_delta_s)):
                files = [_file(store, version, f.file) for f in store.read_manifest(version).files]
                raw.append(_timed(run.fs.cat, files)[0])
        rows.append(
            {
                "backend": backend,
                "full_MB": store.read_manifest(1).stored_bytes / MB,
                "delta_MB": store.read_manifest(2).stored_bytes / MB,
                "full_load_s": min(full_s),
                "raw_get_full_s": min(raw_full_s),
                "full_vs_raw": min(raw_full_s) / min(full_s),
                "delta_load_s": min(delta_s),
                "raw_get_delta_s": min(raw_delta_s),
            }
        )
    results.put(rows)


def _in_process(target: Callable, *args: Any) -> Any:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, results))
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"{target.__name__} failed: exit code {proc.exitcode}")
    return results.get(timeout=5)


# -- report ------------------------------------------------------------------------------------


def report_publish(rows: list[dict]) -> None:
    print("\n## Publish (WeightPublisher, full versions) and verified load vs raw fsspec\n")
    print(markdown_table([{k: v for k, v in r.items() if k != "profile"} for r in rows]))
    for r in rows:
        print(
            f"goal ≥ {GOAL_RAW}× raw, {r['ranks']} rank(s) {r['backend']} {r['dtype']}: "
            f"publish {r['publish_vs_raw']:.2f}× {_met(r['publish_vs_raw'] >= GOAL_RAW)}, "
            f"load {r['load_vs_raw']:.2f}× {_met(r['load_vs_raw'] >= GOAL_RAW)}"
        )
    for r in rows:
        if "profile" in r:
            total = sum(r["profile"].values())
            print(
                f"\nwhere one rank's {r['dtype']} version goes ({r['backend']}, "
                f"{r['MB']:.0f} MB, steps run one after another, total {total:.2f} s):"
            )
            for step, seconds in r["profile"].items():
                print(
                    f"  {step:32s} {seconds:7.3f} s  {seconds / total:5.1%}  "
                    f"{r['MB'] / seconds:8.0f} MB/s"
                )


def report_step(result: dict, args: argparse.Namespace) -> None:
    bare, with_ = statistics.mean(result["bare"]), statistics.mean(result["with"])
    sync = statistics.mean(result["sync"])
    lost = (with_ - bare) / bare
    print(
        f"\n## Training time lost to publishing ({args.step_ranks} rank(s), batch "
        f"{args.batch}×{args.seq}, lr {args.lrs[0]:g}, bf16 published every step)\n"
    )
    print(
        markdown_table(
            [
                {
                    "steps": len(result["bare"]),
                    "step_s": bare,
                    "step_s_min": min(result["bare"]),
                    "step_plus_publish_s": with_,
                    "step_plus_publish_min_s": min(result["with"]),
                    "lost_frac": lost,
                    "weight_sync_s": sync,
                    "weight_sync_frac": sync / bare,
                }
            ]
        )
    )
    uploads = ", ".join(f"{s:.2f}s{' full' if f else ' delta'}" for s, f in result["uploads"])
    print(
        f"background uploads (perf/weight_upload_s): {uploads}; "
        f"last flush {result['flush_s']:.2f}s (its upload {result['last_upload_s']:.2f}s); "
        f"versions {result['versions']}, full {result['full']}"
    )
    print(
        f"goal ≤ {GOAL_LOST:.0%} of a step: step time lost {lost:.1%} "
        f"{_met(lost <= GOAL_LOST)}; on the training path (perf/weight_sync_s) "
        f"{sync / bare:.1%} {_met(sync / bare <= GOAL_LOST)}"
    )


def report_delta(rows: list[dict]) -> None:
    print("\n## Delta vs full versions after AdamW steps (fp32 master, bf16 published)\n")
    print(markdown_table(rows))
    small = [r["delta_vs_full"] for r in rows if r["lr"] == 1e-6]
    if small:
        print(
            f"goal delta ≤ {GOAL_DELTA:.0%} of full at lr 1e-6: worst {max(small):.1%} "
            f"{_met(max(small) <= GOAL_DELTA)}; rebuilt weights bit-identical: yes (asserted)"
        )


def report_load(rows: list[dict]) -> None:
    print("\n## Engine.advance_weights (read + verify + build + reload into vLLM) vs raw read\n")
    print(markdown_table(rows))
    for r in rows:
        print(
            f"goal ≥ {GOAL_RAW}× raw, {r['backend']}: full load {r['full_vs_raw']:.2f}× "
            f"{_met(r['full_vs_raw'] >= GOAL_RAW)}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="qwen2.5-0.5b-shape", help="bundled model name")
    parser.add_argument(
        "--phases",
        default="hash,publish,step,delta,load",
        help="comma-separated, of hash, publish, step, delta, load",
    )
    parser.add_argument("--backends", default="local,seaweedfs", help="local and/or seaweedfs")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="publish phase")
    parser.add_argument("--repeats", type=int, default=2, help="versions per publish case")
    parser.add_argument("--hash-mib", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2, help="rows per training step")
    parser.add_argument("--seq", type=int, default=128, help="tokens per row")
    parser.add_argument("--steps", type=int, default=3, help="measured steps (step, delta)")
    parser.add_argument("--warmup", type=int, default=1, help="training steps not measured")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--step-ranks", type=int, default=1)
    parser.add_argument(
        "--load-delta",
        type=float,
        default=0.01,
        help="fraction of elements changed in the load phase's delta",
    )
    args = parser.parse_args()
    # Inherited by the spawned phases: progress bars and vLLM's per-update logs off.
    os.environ |= {
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "TQDM_DISABLE": "1",
    }
    phases = args.phases.split(",")
    backends = args.backends.split(",")
    if set(phases) - {"hash", "publish", "step", "delta", "load"}:
        parser.error(f"--phases {args.phases}: of hash, publish, step, delta, load")
    print(f"model {args.model}, {os.cpu_count()} CPU cores, phases {phases}, backends {backends}")
    if "hash" in phases:
        print("\n## Checksum over the same bytes\n")
        print(markdown_table([bench_hash(args.hash_mib)]))
    with tempfile.TemporaryDirectory() as tmp:
        server = SeaweedFS().start() if "seaweedfs" in backends else None
        try:
            locations = []
            if "local" in backends:
                locations.append(("local", os.path.join(tmp, "local"), {}))
            if server is not None:
                locations.append(
                    ("seaweedfs", f"s3://{server.bucket}/bench", server.storage_options)
                )
            if "publish" in phases:
                rows = []
                for world in args.ranks:
                    rows += _in_processes(_publish_rank, world, args.model, locations, args.repeats)
                report_publish(rows)
            step_args = {
                "lr": args.lrs[0],
                "batch": args.batch,
                "seq": args.seq,
                "steps": args.steps,
                "warmup": args.warmup,
                "lrs": args.lrs,
            }
            _, uri, options = locations[0]
            if "step" in phases:
                result = _in_processes(
                    _step_rank, args.step_ranks, args.model, f"{uri}/step", options, step_args
                )
                report_step(result, args)
            if "delta" in phases:
                rows = _in_processes(_delta_rank, 1, args.model, f"{uri}/delta", options, step_args)
                report_delta(rows)
            if "load" in phases:
                report_load(
                    _in_process(_load_main, args.model, locations, args.load_delta, args.repeats)
                )
        finally:
            if server is not None:
                server.stop()


if __name__ == "__main__":
    main()
