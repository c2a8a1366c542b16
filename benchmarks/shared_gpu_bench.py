"""One GPU shared by the learner and a generator: the planned memory and the weight hand-off.

    python -m benchmarks.shared_gpu_bench --device cuda --json out.json    # a GPU machine
    python -m benchmarks.shared_gpu_bench --device cpu --dry-run           # the code path here

What a GPU machine without vLLM can measure of `placement.share_gpus` (the lent machine has no
vLLM, so the engine is a stand-in):
1. the plan: `plan_placement` for the learner and one generator on GPU 0, with the device's real
   size — each one's fraction of the memory, the learner's planned need;
2. a second process, the engine's stand-in, holding the generator's planned share: the policy's
   weights in bf16 (what vLLM loads) and the rest of its share as one block (vLLM's KV cache);
3. the learner in this process, its allocator capped at its share (`cap_learner_memory`):
   FSDP2 on one rank, AdamW, one micro-batch of `learner.micro_batch_tokens` per step, each
   step published through `WeightPublisher` with its hand-off slots — the peak memory it
   reached against its share, seconds per step;
4. each version taken by the stand-in from the learner's GPU memory (`HandOffReader`, CUDA IPC)
   into its weights — seconds per version, bit for bit what storage holds — and the same
   version built from storage and copied to the device for comparison.

What stays unmeasured: vLLM itself beside the learner (its KV cache sizing, sampling speed while
the learner trains), the loop's tokens/s. `--dry-run` runs every step on CPU (tiny-qwen2, host
shared memory), so the default test suite keeps the script alive between leases.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODEL_FULL, MODEL_DRY = "qwen2.5-0.5b-shape", "tiny-qwen2"
GIB = 1 << 30


def plan(device: str, model: str, steps: int) -> dict[str, Any]:
    """The placement of the learner and one generator on GPU 0 (on CPU: no memory plan)."""
    from streamrl.config.loading import load_config
    from streamrl.placement import plan_placement
    from streamrl.placement.gpu_memory import learner_need_bytes, model_shape

    config = load_config(
        overrides=[
            f"model.path={model}",
            f"learner.device={device}",
            f"generator.device={device}",
            f"learner.total_steps={steps}",
            "learner.warmup_steps=0",
            "weights.handoff=true",
            "eval.every_versions=0",
        ]
    )
    gpus = ["0"] if device == "cuda" else []
    placed = plan_placement(config, generators=1, gpus=gpus, cpus=sorted(os.sched_getaffinity(0)))
    out = {
        "micro_batch_tokens": config.learner.micro_batch_tokens,
        "learner_share": placed.learner.gpu_memory_fraction,
        "generator_share": placed.generators[0].gpu_memory_fraction,
        "handoff": placed.generators[0].handoff,
        "reasons": list(placed.reasons),
    }
    if device == "cuda":
        out["learner_need_GiB"] = learner_need_bytes(config, model_shape(config), True) / GIB
    return out


def engine(run_uri: str, device: str, model: str, share: float | None, versions: int) -> None:
    """The generator's stand-in (a child process): holds its share, takes every version."""
    import torch
    from transformers import AutoModelForCausalLM

    from storage.fs import open_location
    from storage.weights.versions import WeightStore
    from streamrl.models import resolve_model_path
    from streamrl.placement.handoff import HandOffReader, handoff_dir

    where = torch.device(device)
    path = resolve_model_path(model)
    weights = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(where)
    params = dict(weights.named_parameters())
    held = None
    if share is not None:  # the rest of its share: vLLM's KV cache
        total = torch.cuda.get_device_properties(0).total_memory
        rest = int(share * total) - torch.cuda.memory_allocated()
        held = torch.empty(max(rest, 0), dtype=torch.uint8, device=where)
    print("engine ready", flush=True)
    store = WeightStore(open_location(run_uri))
    reader = HandOffReader(handoff_dir(run_uri))
    loads: list[dict[str, Any]] = []
    done = 0
    deadline = time.monotonic() + 600
    while done < versions and time.monotonic() < deadline:
        latest = store.read_latest()
        if latest is None or latest <= done:
            time.sleep(0.01)
            continue
        manifest = store.read_manifest(latest)
        started = time.perf_counter()
        taken = reader.take(manifest, where)
        if taken is not None:
            with torch.no_grad():
                for name, tensor in taken.tensors().items():
                    if name in params:
                        params[name].copy_(tensor)
            if where.type == "cuda":
                torch.cuda.synchronize()
        record: dict[str, Any] = {"version": latest, "handoff_s": time.perf_counter() - started}
        record["intact"] = taken is not None and taken.intact()
        started = time.perf_counter()  # the same version through storage: read and verify ...
        stored, _ = store.load(latest)
        read_s = time.perf_counter() - started
        if record["intact"]:  # what the engine holds now is what storage holds
            record["exact"] = all(
                torch.equal(params[name].cpu(), tensor)
                for name, tensor in stored.items()
                if name in params
            )
        started = time.perf_counter()  # ... and copy to the device
        with torch.no_grad():
            for name, tensor in stored.items():
                if name in params:
                    params[name].copy_(tensor.to(where))
        if where.type == "cuda":
            torch.cuda.synchronize()
        record["storage_s"] = read_s + time.perf_counter() - started
        loads.append(record)
        done = latest
        (Path(run_uri) / "engine-took").write_text(str(latest))  # the learner goes on
    del held
    print(json.dumps({"loads": loads}), flush=True)


def learner(run_uri: str, device: str, model: str, share: float | None, steps: int,
            tokens: int) -> dict[str, Any]:  # fmt: skip
    """The learner's side: capped at its share, trains and publishes `steps` versions."""
    import torch

    from storage.fs import open_location
    from storage.weights.publish import WeightWriter
    from streamrl.learner.config import WeightsConfig
    from streamrl.learner.model import load_policy, shard_model
    from streamrl.learner.publish import WeightPublisher
    from streamrl.learner.topology import Topology
    from streamrl.models.config import ModelConfig
    from streamrl.placement.gpu_memory import cap_learner_memory
    from streamrl.placement.handoff import HandOffWriter, handoff_dir

    out: dict[str, Any] = {"steps": []}
    with Topology.from_env(device) as topology:
        if share is not None:
            os.environ["STREAMRL_GPU_MEMORY_FRACTION"] = f"{share:.4f}"
            cap_learner_memory(topology.device.index or 0)
            torch.cuda.reset_peak_memory_stats()
        policy = load_policy(model, ModelConfig(path=model))
        shard_model(policy, topology)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
        writer = WeightWriter(open_location(run_uri))
        slots = HandOffWriter(handoff_dir(run_uri), 0, 1, topology.device)
        publisher = WeightPublisher(writer, topology, WeightsConfig(full_every=1), torch.bfloat16,
                                    handoff=slots)  # fmt: skip
        vocab = policy.config.vocab_size
        generator = torch.Generator().manual_seed(0)
        for version in range(1, steps + 1):
            started = time.perf_counter()
            ids = torch.randint(0, vocab, (1, tokens), generator=generator).to(topology.device)
            loss = policy(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if topology.device.type == "cuda":
                torch.cuda.synchronize()
            step_s = time.perf_counter() - started
            metrics = publisher.publish(policy, version)
            publisher.flush()  # committed: the engine may take it
            _wait_for_engine(run_uri, version)
            out["steps"].append(
                {"step_s": step_s, "handoff_write_s": metrics.get("perf/weight_handoff_s"),
                 "sync_s": metrics["perf/weight_sync_s"]}
            )  # fmt: skip
        if share is not None:
            total = torch.cuda.get_device_properties(topology.device).total_memory
            out["peak_GiB"] = torch.cuda.max_memory_reserved() / GIB
            out["share_GiB"] = share * total / GIB
        out["parameters"] = sum(p.numel() for p in policy.parameters())
        publisher.close()
    return out


def _wait_for_engine(run_uri: str, version: int, timeout_s: float = 120.0) -> None:
    """Until the engine's stand-in took `version` (one version per step, each measured)."""
    took = Path(run_uri) / "engine-took"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if took.exists() and int(took.read_text() or 0) >= version:
            return
        time.sleep(0.01)
    raise TimeoutError(f"the engine's stand-in did not take version {version} in {timeout_s} s")


def run(
    device: str, dry_run: bool, steps: int, model: str | None = None, tokens: int | None = None
) -> dict[str, Any]:
    from streamrl.models import resolve_model_path
    from streamrl.placement.handoff import remove_handoff

    model = model or (MODEL_DRY if dry_run else MODEL_FULL)
    resolve_model_path(model)  # built once, before two processes need it
    report: dict[str, Any] = {"device": device, "model": model, "plan": plan(device, model, steps)}
    tokens = tokens or (64 if dry_run else report["plan"]["micro_batch_tokens"])
    report["tokens_per_step"] = tokens
    with tempfile.TemporaryDirectory() as folder:
        run_uri = str(Path(folder) / "run")
        Path(run_uri).mkdir()
        share = report["plan"]["generator_share"]
        child = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.shared_gpu_bench", "--engine", run_uri,
             "--device", device, "--model", model, "--share", str(share or 0),
             "--steps", str(steps)],
            cwd=ROOT, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert child.stdout is not None
            if child.stdout.readline().strip() != "engine ready":
                raise RuntimeError("the engine's stand-in did not start")
            report["learner"] = learner(run_uri, device, model, report["plan"]["learner_share"],
                                        steps, tokens)  # fmt: skip
            output, _ = child.communicate(timeout=300)
            report["engine"] = json.loads(output.strip().splitlines()[-1])
        finally:
            if child.poll() is None:
                child.kill()
            remove_handoff(run_uri)
    loads = report["engine"]["loads"]
    handed = [x for x in loads if x["intact"]]
    report["handoff_s_per_version"] = min((x["handoff_s"] for x in handed), default=None)
    report["storage_s_per_version"] = min((x["storage_s"] for x in loads), default=None)
    report["exact"] = bool(handed) and all(x.get("exact") for x in handed)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--dry-run", action="store_true", help="tiny-qwen2 on CPU")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model", help=f"default {MODEL_FULL} ({MODEL_DRY} with --dry-run)")
    parser.add_argument("--tokens", type=int, help="per step (default learner.micro_batch_tokens)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--engine", help=argparse.SUPPRESS)  # the child: its run folder
    parser.add_argument("--share", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine:
        engine(args.engine, args.device, args.model, args.share or None, args.steps)
        return 0
    report = run(args.device, args.dry_run, args.steps, args.model, args.tokens)
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0 if report["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
