"""Storage throughput: the replay stream and the weight store against raw fsspec I/O of the same
bytes, on a local folder and on SeaweedFS (a real S3 server on 127.0.0.1), plus commit-log
throughput with 1, 4 and 16 concurrent writer processes.

    .venv/bin/python -m benchmarks.storage_bench [--groups 48] [--weights-mib 256] [--seconds 10]

Prints one table per measurement; every ratio compares two figures taken in the same run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from storage.fs import Location, open_location
from storage.seaweedfs import SeaweedFS
from storage.stream.segments import encode_segment
from storage.stream.writer import StreamReader, StreamWriter
from storage.weights.publish import WeightWriter
from tests.stream_data import random_group

MB = 1e6


def _best_of(repeats: int, fn: Callable[[], object]) -> float:
    """Fastest wall time of `repeats` runs (the least disturbed by the 2-core machine)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def realistic_groups(count: int, seed: int = 0) -> list:
    """G = 16 responses of 50–4096 tokens (log-uniform), 150k vocabulary."""
    rng = np.random.default_rng(seed)
    groups = []
    for i in range(count):
        group = random_group(
            rng, prompt_id=f"p{i}", group_size=16, min_len=50, max_len=4096,
            prompt_len=int(rng.integers(64, 512)), vocab=150_000,
        )  # fmt: skip
        lengths = np.exp(rng.uniform(np.log(50), np.log(4096), 16)).astype(int)
        tokens = [t[:n] for t, n in zip(group.response_tokens, lengths, strict=False)]
        logprobs = [lp[: len(t)] for lp, t in zip(group.behaviour_logprobs, tokens, strict=True)]
        groups.append(
            type(group)(
                **{**group.__dict__, "response_tokens": tokens, "behaviour_logprobs": logprobs}
            )
        )
    return groups


def bench_stream(name: str, run: Location, groups: list, segment_groups: int) -> dict:
    """Stream write (encode + upload + commit) and read (fetch + check + decode) vs raw I/O."""
    segments = [groups[i : i + segment_groups] for i in range(0, len(groups), segment_groups)]
    payload = [encode_segment(s) for s in segments]
    stored = sum(len(b) for objs in payload for b in objs.values())

    def stream_write() -> None:
        writer = StreamWriter(run.child(uuid.uuid4().hex[:8]), "bench")
        for segment in segments:
            writer.write(segment)

    target = run.child("read")
    reader_log = StreamWriter(target, "bench")
    for segment in segments:  # the same segments, read back repeatedly
        reader_log.write(segment)

    def stream_read() -> None:
        it = StreamReader(target).groups(timeout_s=5)
        for _ in range(len(groups)):
            next(it)

    raw_root = run.child("raw")

    def raw_paths(prefix: str) -> dict[str, bytes]:
        return {
            raw_root.join(prefix, f"s{i}", key): data
            for i, objs in enumerate(payload)
            for key, data in objs.items()
        }

    def raw_put() -> None:
        paths = raw_paths(uuid.uuid4().hex[:8])
        if run.is_local:
            for parent in {p.rsplit("/", 1)[0] for p in paths}:
                run.fs.makedirs(parent, exist_ok=True)
        for i in range(len(payload)):  # one put round per segment, as the writer does
            run.fs.pipe({p: d for p, d in paths.items() if f"/s{i}/" in p})

    read_paths = raw_paths("fixed")
    if run.is_local:
        for parent in {p.rsplit("/", 1)[0] for p in read_paths}:
            run.fs.makedirs(parent, exist_ok=True)
    run.fs.pipe(read_paths)

    def raw_get() -> None:
        run.fs.cat(list(read_paths))

    t_write, t_put = _best_of(3, stream_write), _best_of(3, raw_put)
    t_read, t_get = _best_of(3, stream_read), _best_of(3, raw_get)
    return {
        "backend": name,
        "stored_MB": stored / MB,
        "write_groups_s": len(groups) / t_write,
        "write_MB_s": stored / MB / t_write,
        "raw_put_MB_s": stored / MB / t_put,
        "write_vs_raw": t_put / t_write,
        "read_groups_s": len(groups) / t_read,
        "read_MB_s": stored / MB / t_read,
        "raw_get_MB_s": stored / MB / t_get,
        "read_vs_raw": t_get / t_read,
    }


def bench_weights(name: str, run: Location, size_mib: int) -> dict:
    """publish (shard + xxh3 checksums + upload + part + manifest + LATEST) and verified load
    vs raw put/get."""
    generator = torch.Generator().manual_seed(0)
    # A transformer-like state dict: bf16 matrices of 8 MiB each.
    count = max(1, size_mib // 8)
    state = {
        f"layers.{i}.weight": torch.randn(2048, 2048, generator=generator).bfloat16()
        for i in range(count)
    }
    writer = WeightWriter(run.child(f"weights-{uuid.uuid4().hex[:8]}"))
    store = writer.reader
    shard_bytes = 64 * 1024**2
    versions = iter(range(1, 100))
    t_publish = _best_of(3, lambda: writer.publish(next(versions), state, shard_bytes=shard_bytes))
    latest = store.latest_version()
    t_load = _best_of(3, lambda: store.load(latest))
    manifest = store.read_manifest(latest)
    shard_paths = [store.root.join(f"v{latest:08d}", s.file) for s in manifest.files]
    payload = {p: run.fs.cat_file(p) for p in shard_paths}
    stored = sum(len(b) for b in payload.values())
    raw_root = run.child(f"raw-weights-{uuid.uuid4().hex[:8]}")
    if run.is_local:
        run.fs.makedirs(raw_root.path, exist_ok=True)

    def raw_put() -> None:
        run.fs.pipe({raw_root.join(p.rsplit("/", 1)[1]): b for p, b in payload.items()})

    t_put = _best_of(3, raw_put)
    t_get = _best_of(3, lambda: run.fs.cat([raw_root.join(p.rsplit("/", 1)[1]) for p in payload]))
    return {
        "backend": name,
        "size_MB": stored / MB,
        "publish_s": t_publish,
        "publish_MB_s": stored / MB / t_publish,
        "raw_put_MB_s": stored / MB / t_put,
        "publish_vs_raw": t_put / t_publish,
        "load_s": t_load,
        "load_MB_s": stored / MB / t_load,
        "raw_get_MB_s": stored / MB / t_get,
        "load_vs_raw": t_get / t_load,
    }


def _commit_worker(
    uri: str, env: dict, ready: Any, seconds: float, results: mp.Queue
) -> None:  # pragma: no cover - runs in a child process
    os.environ.update(env)
    rng = np.random.default_rng(os.getpid())
    writer = StreamWriter(open_location(uri), f"w{os.getpid()}")
    uploaded = writer.upload([random_group(rng, group_size=2, max_len=8)])
    ready.wait()  # every writer imported, connected and holding a segment
    commits, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        writer.commit(uploaded)  # the same tiny segment again: this measures the log alone
        commits += 1
    results.put((commits, writer.stats.commit_conflicts))


def bench_commits(server: SeaweedFS, writers: int, seconds: float) -> dict:
    """Commits/s of `writers` processes racing for the one log, and conflicts per commit."""
    uri = f"s3://{server.bucket}/bench-commits/{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    ready, results = ctx.Barrier(writers), ctx.Queue()
    procs = [
        ctx.Process(target=_commit_worker, args=(uri, server.env, ready, seconds, results))
        for _ in range(writers)
    ]
    for proc in procs:
        proc.start()
    counts = []
    for _ in procs:
        while True:
            try:
                counts.append(results.get(timeout=5))
                break
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError("a commit benchmark writer failed") from None
    for proc in procs:
        proc.join()
    commits = sum(c for c, _ in counts)
    conflicts = sum(x for _, x in counts)
    return {
        "writers": writers,
        "commits_s": commits / seconds,
        "per_writer_commits_s": commits / seconds / writers,
        "conflicts_per_commit": conflicts / max(commits, 1),
    }


def markdown_table(rows: list[dict]) -> str:
    """`rows` (dicts with the same keys) as a markdown table, floats to 3 significant digits."""
    keys = list(rows[0])
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--groups", type=int, default=48, help="groups per stream measurement")
    parser.add_argument("--segment-groups", type=int, default=16)
    parser.add_argument("--weights-mib", type=int, default=256, help="state-dict size")
    parser.add_argument("--seconds", type=float, default=10.0, help="commit benchmark length")
    parser.add_argument("--writers", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()

    groups = realistic_groups(args.groups)
    tokens = sum(g.num_tokens for g in groups)
    print(f"stream: {len(groups)} groups, G=16, {tokens} response tokens")
    with tempfile.TemporaryDirectory() as tmp, SeaweedFS() as server:
        local = open_location(os.path.join(tmp, "run"))
        s3 = open_location(f"s3://{server.bucket}/bench", storage_options=server.storage_options)
        rows = [
            bench_stream(name, run, groups, args.segment_groups)
            for name, run in (("local", local), ("seaweedfs", s3))
        ]
        print("\n## Replay stream vs raw fsspec put/get of the same bytes\n")
        print(markdown_table(rows))
        print("\n## Weight store publish/load vs raw copy of the same bytes\n")
        print(
            markdown_table(
                [
                    bench_weights(n, r, args.weights_mib)
                    for n, r in (("local", local), ("seaweedfs", s3))
                ]
            )
        )
        print("\n## Commit log on SeaweedFS: concurrent writers\n")
        print(markdown_table([bench_commits(server, n, args.seconds) for n in args.writers]))


if __name__ == "__main__":
    main()
