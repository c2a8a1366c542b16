"""Learner throughput: the learner's step on today's path and on the fast one, against a bare
forward + backward + AdamW step of the same model, plus `Learner.train_step()` itself, MFU,
peak memory and weight publish time, on CPU or on one GPU.

    .venv/bin/python -m benchmarks.learner_bench [--model smollm2-135m-instruct] [--repeats 3]
    .venv/bin/python -m benchmarks.learner_bench --group-size 8 --prompt-len 64 76 \
        --min-response-len 16 --max-response-len 64          # the demo's shapes
    .venv/bin/python -m benchmarks.learner_bench --groups 2 --group-size 8 \
        --prompt-len 512 512 --max-response-len 128          # a long shared prompt

On one GPU (the issue's measurement: Qwen2.5-0.5B's shape, DAPO, G = 16, responses of
512–2048 tokens, bf16 mixed precision with fp32 master weights; `scripts/device_wheels.sh`
prints the whole device command, with the wheels that machine lacks):

    python3 -m benchmarks.learner_bench --device cuda --model qwen2.5-0.5b-shape \
        --group-size 16 --min-response-len 512 --max-response-len 2048 \
        --phases bare,today,new,learner

`--device cuda` sets `learner.device=cuda` and `learner.mixed_precision=bf16` (what the GPU
presets configure), for every phase alike: the bare phase shards the same model with the same
FSDP2 mixed-precision policy. MFU is model FLOPs (`benchmarks.learner_measures`) per second
over `--peak-tflops`, by default the dense bf16 peak of the GPU's name (989 for H100 SXM and
H200); on CPU only when `--peak-tflops` is given.

One run directory holds a replay stream of synthetic DAPO groups (policy version 0, varied
response lengths, rewards with variance so dynamic sampling keeps every group): `--batches`
distinct batches of B groups, each written `--repeats` times in a row, after one warm-up copy
of the first. The phases read it, each in its own process so that their memory peaks do not
mix (`--phases`; every phase process lives for the whole run, so mind the machine's memory):

- *learner*: `Learner(config, run, topology).train_step()`, which reads a batch from the stream,
  builds micro-batches, trains (DAPO loss, entropy metric, gradient clipping, metrics
  all-reduce) and publishes the weights. Its time is the learner's own `perf/step_s`
  (everything but the publish); the publish's time on the training path (the snapshot of the
  shard from device memory; the upload runs in the background) is its `perf/weight_sync_s`,
  and the background upload's time and bytes are its `perf/weight_upload_s` and
  `weights/stored_bytes`.
- *bare*: the same FSDP2-wrapped model and AdamW settings on the micro-batches rebuilt from the
  same groups in the same order (`TrainBatch.from_groups` + `make_mini_batches`, outside the
  timed region, a padded row per response): forward, a log-softmax-gather loss on the
  targets, backward, optimiser step.
- *today*: the learner's step (`train_on_batch`: DAPO's scoring, loss, metrics) on those rows
  with the model's full logits: the path before shared prompts and the response-only head.
- *new*: the same step on the fast path: shared-prompt rows (`learner.shared_prompt=on`) and
  the LM head only on response positions (`use_hidden_states_head`).

The parent runs the processes in lockstep: step k of each right after step k of the others
(on the same batch), so that all see the same machine load. Both count loss tokens
(`loss_mask`) per second after the warm-up steps: over all measured steps, and best-of-repeats
(each batch's fastest step, the least disturbed on a shared machine). Memory on CPU is the
resident set size (RSS, Linux `/proc`): sampled every 5 ms and split into training and
publishing windows, and the process's exact high-water mark (`ru_maxrss`); on a GPU it is the
CUDA allocator's peak per step (`benchmarks.learner_measures`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig

from benchmarks.learner_measures import (
    ModelShape,
    default_peak_tflops,
    device_name,
    figures_json,
    memory_meter,
    synchronize,
)
from storage.control.manifest import create_run, open_run
from storage.fs import Location, open_location
from storage.stream.records import ScoredGroup
from storage.stream.writer import StreamReader, StreamWriter
from storage.weights.publish import WeightWriter
from storage.weights.versions import WeightStore
from streamrl.config.loading import load_config, validate_config
from streamrl.config.run import RunConfig
from streamrl.learner.forward import use_hidden_states_head
from streamrl.learner.loop import Learner
from streamrl.learner.mini_batches import MiniBatch, TrainBatch, make_mini_batches
from streamrl.learner.model import full_state_dict, load_policy, shard_model
from streamrl.learner.optim import build_optimizer
from streamrl.learner.step import StepModels, StepSettings, Trainable, train_on_batch
from streamrl.learner.topology import Topology
from streamrl.models import resolve_model_path

ROOT = Path(__file__).resolve().parents[1]
MB = 1e6
# Bundled model → the size preset and overrides its runs start from.
MODELS = {
    "smollm2-135m-instruct": ("smollm2-cpu", []),
    "tiny-qwen2": ("tiny-cpu", []),
    "qwen2.5-0.5b-shape": (
        "tiny-cpu",
        ["model.path=qwen2.5-0.5b-shape", "model.dtype=bfloat16", "weights.full_every=1"],
    ),
}
# Default micro-batch budget: the CPU presets' size, or what keeps a 0.5B model's activations
# of four phase processes within one 80 GB GPU; never below the longest sequence.
MICRO_BATCH_TOKENS = {"cpu": 1024, "cuda": 8192}


# -- the run: config and a synthetic stream ------------------------------------------------


def micro_batch_tokens(args: argparse.Namespace) -> int:
    """`--micro-batch-tokens`, else the device's default raised to the longest sequence."""
    if args.micro_batch_tokens is not None:
        return args.micro_batch_tokens
    return max(MICRO_BATCH_TOKENS[args.device], args.prompt_len[1] + args.max_response_len)


def shape_overrides(args: argparse.Namespace) -> list[str]:
    """The overrides of the model's size preset for the benchmark's model, device and batch
    shape (B groups of G responses, one mini-batch). CUDA: bf16 mixed precision, as the GPU
    presets."""
    _, model_overrides = MODELS[args.model]
    on_device = [f"learner.device={args.device}"]
    if args.device == "cuda":
        on_device.append("learner.mixed_precision=bf16")
    if args.activation_checkpointing:
        on_device.append("learner.activation_checkpointing=true")
    return [
        *model_overrides,
        *on_device,
        f"generator.group_size={args.group_size}",
        f"generator.max_tokens={args.max_response_len}",
        f"data.max_prompt_len={args.prompt_len[1]}",
        f"model.max_model_len={max(2048, args.prompt_len[1] + args.max_response_len)}",
        f"learner.batch_groups={args.groups}",
        f"learner.mini_batch_groups={args.groups}",
        f"learner.micro_batch_tokens={micro_batch_tokens(args)}",
        "logging.wandb_mode=disabled",
    ]


def bench_config(args: argparse.Namespace, run_dir: str) -> RunConfig:
    """DAPO with the model's size preset, resized to the benchmark's batch, on `--device`
    (`shape_overrides`). No checkpoints, no staleness drops, no wandb: every measured step
    trains on the next B groups of the stream."""
    return load_config(
        ["dapo", MODELS[args.model][0]],
        overrides=[
            *shape_overrides(args),
            f"storage.run_uri={run_dir}",
            f"learner.total_steps={args.warmup_steps + args.batches * args.repeats + 1}",
            "learner.warmup_steps=0",
            "learner.publish_every=1",
            "learner.checkpoint_every=1000000",
            "learner.max_staleness=1000000",
        ],
    )


def synthetic_groups(
    count: int,
    group_size: int,
    min_len: int,
    max_len: int,
    vocab: int,
    prompt_len: tuple[int, int] = (32, 64),
    seed: int = 0,
) -> list[ScoredGroup]:
    """`count` groups of `prompt_len` (a low–high range) prompts and `min_len`–`max_len`-token
    responses (uniform; those of `max_len` count as truncated), half of each group rewarded +1
    and half −1."""
    rng = np.random.default_rng(seed)
    groups = []
    for i in range(count):
        lengths = rng.integers(min_len, max_len + 1, size=group_size)
        truncated = lengths == max_len
        correct = rng.permutation(np.arange(group_size) < group_size // 2)
        prompt_length = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        now = time.time()
        groups.append(
            ScoredGroup(
                prompt_id=f"p{i}",
                prompt_tokens=rng.integers(0, vocab, size=prompt_length, dtype=np.int32),
                ground_truth="0",
                response_tokens=[rng.integers(0, vocab, size=n, dtype=np.int32) for n in lengths],
                behaviour_logprobs=[-rng.exponential(1.0, n).astype(np.float32) for n in lengths],
                rewards=np.where(correct, 1.0, -1.0).astype(np.float32),
                raw_scores=correct.astype(np.float32),
                truncated=truncated,
                finish_reasons=["length" if t else "stop" for t in truncated],
                policy_version=0,
                generator_id="bench",
                created_at=now - 1.0,
                finished_at=now,
            )
        )
    return groups


def prepare_run(args: argparse.Namespace, run_dir: str) -> tuple[RunConfig, ModelShape, list]:
    """Create the run (run.json) and write its stream, one segment per step: the first batch
    for each warm-up step, then each of the distinct batches `repeats` times. Returns the
    config, the model's shape and the model FLOPs of each measured step."""
    config = bench_config(args, run_dir)
    run = open_location(run_dir)
    create_run(run, config.model_dump(mode="json"))
    model_dir = resolve_model_path(config.model.path)
    shape = ModelShape.of(model_dir)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    B = args.groups
    groups = synthetic_groups(
        B * args.batches,
        args.group_size,
        args.min_response_len,
        args.max_response_len,
        vocab,
        tuple(args.prompt_len),
    )
    batches = [groups[b * B : (b + 1) * B] for b in range(args.batches)]
    writer = StreamWriter(run, "bench")
    measured = [batch for batch in batches for _ in range(args.repeats)]
    for batch in [batches[0]] * args.warmup_steps + measured:
        writer.write(batch)
    return config, shape, [shape.batch_flops(batch) for batch in measured]


# -- the phases (each in a child process) --------------------------------------------------


UPLOAD_METRICS = {"upload_s": "perf/weight_upload_s", "stored_bytes": "weights/stored_bytes"}


class LearnerPhase:
    """`Learner.train_step()`; per step the learner's own figures (its metrics)."""

    def __init__(self, config: RunConfig, run: Location) -> None:
        self.config, self.run = config, run
        self.memory = memory_meter(config.learner.device)
        self.topology = Topology.from_env(config.learner.device)
        self.learner = Learner(config, run, self.topology)
        self.memory.set_up()

    def step(self) -> dict[str, Any]:
        self.memory.begin_step()
        started = time.perf_counter()
        metrics = self.learner.train_step()
        wall_s = time.perf_counter() - started
        if metrics["stream/consumed"] != self.config.learner.batch_groups:
            raise RuntimeError(f"a step skipped stream groups, so the phases differ: {metrics}")
        step_s, sync_s = metrics["perf/step_s"], metrics["perf/weight_sync_s"]
        train_end = started + step_s
        self.memory.end_step((started, train_end), (train_end, train_end + sync_s))
        tokens = round(metrics["perf/learner_tokens_per_s"] * (step_s - metrics["perf/wait_s"]))
        # The previous version's background upload, reported once it has finished.
        upload = {key: metrics[name] for key, name in UPLOAD_METRICS.items() if name in metrics}
        return {"tokens": tokens, "step_s": step_s, "sync_s": sync_s, "wall_s": wall_s, **upload}

    def finish(self, warmup: int) -> dict[str, Any]:
        self.learner.publisher.flush()
        store = WeightStore(self.run)
        manifest = store.read_manifest(store.latest_version())
        self.topology.destroy()
        return {"weights_MB": manifest.stored_bytes / MB, **self.memory.figures(warmup)}


def bare_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, minis: list[MiniBatch]):
    """Forward, −mean log p(target) over the loss tokens, backward, AdamW: nothing else."""
    model.train()
    for mini in minis:
        optimizer.zero_grad(set_to_none=True)
        for micro in mini.micro_batches:
            logits = model(input_ids=micro.input_ids, attention_mask=micro.attention_mask).logits
            logp = logits[:, :-1].log_softmax(-1).gather(-1, micro.targets.unsqueeze(-1))
            # Divided by the loss tokens of the whole mini-batch, as the learner's token-mean.
            loss = -(logp.squeeze(-1) * micro.loss_mask).sum() / mini.num_loss_tokens
            loss.backward()
        optimizer.step()


class BarePhase:
    """The same model, optimiser settings and micro-batches (built here, untimed; on the
    device before the timer starts), trained by `bare_step`, one batch of B stream groups per
    step in stream order."""

    shared_prompt = False  # a row per response

    def __init__(self, config: RunConfig, run: Location, model: torch.nn.Module | None = None):
        cfg = config.learner
        self.config, self.run = config, run
        self.memory = memory_meter(cfg.device)
        self.topology = Topology.from_env(cfg.device)
        model = model if model is not None else load_policy(config.model.path, config.model)
        self.model = shard_model(
            model, self.topology, cfg.mixed_precision, cfg.activation_checkpointing
        )
        self.optimizer = build_optimizer(
            self.model.parameters(), cfg.lr, cfg.weight_decay, cfg.betas, cfg.eps
        )
        self.groups = StreamReader(run).groups(timeout_s=60)
        self.memory.set_up()

    def step(self) -> dict[str, Any]:
        """The next B stream groups as micro-batches (untimed), then the timed `train`."""
        cfg, device = self.config.learner, self.topology.device
        train = TrainBatch.from_groups([next(self.groups) for _ in range(cfg.batch_groups)])
        minis = make_mini_batches(
            train,
            cfg.mini_batch_groups,
            cfg.micro_batch_tokens,
            overlong_filter=self.config.algorithm.overlong.filter,
            shared_prompt=self.shared_prompt,
        )
        minis = [
            replace(m, micro_batches=tuple(b.to(device) for b in m.micro_batches)) for m in minis
        ]
        self.memory.begin_step()
        started = time.perf_counter()
        extra = self.train(train, minis)
        synchronize(device)
        step_s = time.perf_counter() - started
        self.memory.end_step((started, started + step_s), None)
        forward = sum(m.input_ids.numel() for mini in minis for m in mini.micro_batches)
        tokens = sum(m.num_loss_tokens for m in minis)
        return {"tokens": tokens, "step_s": step_s, "forward_tokens": forward, **extra}

    def train(self, train: TrainBatch, minis: list[MiniBatch]) -> dict[str, Any]:
        bare_step(self.model, self.optimizer, minis)
        return {}

    def finish(self, warmup: int) -> dict[str, Any]:
        # The one-process publish path, in its two parts: gather the full weights (from device
        # memory to the host), then write a version (serialise + xxh3 checksums + write +
        # manifest + LATEST).
        started = time.perf_counter()
        state = full_state_dict(self.model, self.topology)
        gather_s = time.perf_counter() - started
        started = time.perf_counter()
        writer = WeightWriter(self.run.child("bare"))
        writer.publish(1, state, shard_bytes=self.config.weights.shard_bytes)
        write_s = time.perf_counter() - started
        self.groups.close()
        self.topology.destroy()
        return {
            "gather_s": gather_s,
            "write_s": write_s,
            "bare_weights_MB": writer.reader.read_manifest(1).stored_bytes / MB,
            **self.memory.figures(warmup),
        }


class StepPhase(BarePhase):
    """The learner's step, `train_on_batch` (DAPO), on the micro-batches built here (untimed):
    `fast` on shared-prompt rows with the response-only LM head, else a row per response with
    full logits (today's path)."""

    def __init__(self, config: RunConfig, run: Location, *, fast: bool) -> None:
        model = load_policy(config.model.path, config.model)
        if fast:
            use_hidden_states_head(model)
        self.shared_prompt = fast
        super().__init__(config, run, model)
        self.models = StepModels(Trainable(self.model, self.optimizer))
        self.settings = StepSettings.from_config(config)

    def train(self, train: TrainBatch, minis: list[MiniBatch]) -> dict[str, Any]:
        metrics = train_on_batch(
            self.models, train, minis, self.config.algorithm, self.settings, self.topology
        )
        return {"loss": metrics["actor/pg_loss"]}

    def finish(self, warmup: int) -> dict[str, Any]:
        self.groups.close()
        self.topology.destroy()
        return self.memory.figures(warmup)


PHASES = {
    "bare": BarePhase,
    "today": lambda config, run: StepPhase(config, run, fast=False),
    "new": lambda config, run: StepPhase(config, run, fast=True),
    "learner": LearnerPhase,
}


# The parent drives the children in lockstep over their stdin/stdout, one step at a time, so
# that the steps on the same batch run back to back under the same machine load.
REPLY = "@learner_bench "


def _phase_main(args: argparse.Namespace) -> None:  # pragma: no cover - a child process
    run = open_location(args.run)
    config = validate_config(open_run(run).config, source=f"{args.run}/run.json")
    phase = PHASES[args.phase](config, run)
    reply = lambda obj: print(REPLY + json.dumps(obj), flush=True)  # noqa: E731
    reply({"device": device_name(config.learner.device)})
    for line in sys.stdin:
        if line.strip() == "step":
            reply(phase.step())
        else:
            reply(phase.finish(int(line.split()[1])))
            return


class PhaseProcess:
    """One phase in a fresh Python process; `ask` sends a command and returns its reply."""

    def __init__(self, phase: str, run_dir: str) -> None:
        self.phase = phase
        self.stderr = open(os.path.join(run_dir, f"{phase}.stderr"), "w+")  # noqa: SIM115
        env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
        env |= {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.learner_bench", "--phase", phase, "--run", run_dir],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
        )

    def ask(self, command: str | None = None) -> dict[str, Any]:
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY) :])
        self.proc.wait()
        self.stderr.seek(0)
        raise RuntimeError(f"the {self.phase} phase failed:\n{self.stderr.read()[-4000:]}")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()
        self.stderr.close()


def run_phases(
    run_dir: str, warmup: int, steps: int, phases: list[str]
) -> tuple[str, dict[str, dict]]:
    """The `phases`, step k of each right after step k of the others (the order rotates):
    the device they ran on, and per phase its measured `steps` rows and `finish` figures."""
    procs = [PhaseProcess(name, run_dir) for name in phases]
    try:
        devices = {proc.ask()["device"] for proc in procs}  # set up
        rows: dict[str, list] = {proc.phase: [] for proc in procs}
        for k in range(warmup + steps):
            for proc in procs[k % len(procs) :] + procs[: k % len(procs)]:
                rows[proc.phase].append(proc.ask("step"))
        results = {
            proc.phase: {"steps": rows[proc.phase][warmup:]} | proc.ask(f"finish {warmup}")
            for proc in procs
        }
    finally:
        for proc in procs:
            proc.close()
    return ", ".join(sorted(devices)), results


# -- report --------------------------------------------------------------------------------


def _rate(rows: list[dict], key: str = "tokens") -> float:
    """`key` (tokens, flops) per second of step time over `rows`."""
    return sum(r[key] for r in rows) / sum(r["step_s"] for r in rows)


def _best(rows: list[dict], repeats: int) -> list[dict]:
    """Each batch's fastest repeat."""
    batches = [rows[i : i + repeats] for i in range(0, len(rows), repeats)]
    return [min(batch, key=lambda r: r["step_s"]) for batch in batches]


def _best_rate(rows: list[dict], repeats: int, key: str = "tokens") -> float:
    return _rate(_best(rows, repeats), key)


def _mfu(rows: list[dict], peak_tflops: float | None) -> str:
    return "–" if peak_tflops is None else f"{_rate(rows, 'flops') / (peak_tflops * 1e12):.1%}"


NAMES = {
    "bare": "bare fwd+bwd+AdamW (a row per response)",
    "today": "learner step, today's path",
    "new": "learner step, shared prompts + response-only head",
    "learner": "Learner.train_step (new path, + stream, publish)",
}


def report(
    results: dict[str, dict], repeats: int, flops: list[float], peak_tflops: float | None
) -> None:
    rows = {name: result["steps"] for name, result in results.items()}
    if len({tuple(r["tokens"] for r in steps) for steps in rows.values()}) != 1:
        raise RuntimeError("the phases trained on different loss tokens; not comparable")
    for steps in rows.values():
        for row, step_flops in zip(steps, flops, strict=True):
            row["flops"] = step_flops
    tokens = statistics.mean(r["tokens"] for r in rows["bare"])
    memory = results["bare"]["mem_kind"]
    print(f"\n| phase | response tokens/step | forward tokens/step | s/step | tokens/s | "
          f"best-of tokens/s | MFU | best-of MFU | {memory} setup MB | {memory} peak train MB | "
          f"{memory} high-water MB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, result in results.items():
        steps = result["steps"]
        forward = statistics.mean(r.get("forward_tokens", float("nan")) for r in steps)
        print(
            f"| {NAMES[name]} | {tokens:.0f} | {forward:.0f} | "
            f"{statistics.mean(r['step_s'] for r in steps):.3g} | {_rate(steps):.1f} | "
            f"{_best_rate(steps, repeats):.1f} | {_mfu(steps, peak_tflops)} | "
            f"{_mfu(_best(steps, repeats), peak_tflops)} | {result['mem_setup_MB']:.0f} | "
            f"{result['mem_train_MB']:.0f} | {result['mem_high_water_MB']:.0f} |"
        )
    best = {name: _best_rate(steps, repeats) for name, steps in rows.items()}
    print(
        f"\nnew / today response tokens/s: {best['new'] / best['today']:.2f}× best-of-repeats "
        f"(goal ≥ 2×), {_rate(rows['new']) / _rate(rows['today']):.2f}× over all measured "
        f"steps; new / bare {best['new'] / best['bare']:.2f}×"
    )
    losses = [(a["loss"], b["loss"]) for a, b in zip(rows["today"], rows["new"], strict=True)]
    print(f"policy loss, today vs new (first measured step): {losses[0][0]:.6f} vs "
          f"{losses[0][1]:.6f} (later steps diverge only by float rounding)")  # fmt: skip
    bare = results["bare"]
    print(
        f"publish from the bare phase's model: full_state_dict (device → host) "
        f"{bare['gather_s']:.3g} s + WeightWriter.publish {bare['write_s']:.3g} s for "
        f"{bare['bare_weights_MB']:.0f} MB"
    )
    if "learner" in results:
        report_learner(rows, results["learner"], best)


def summary(
    device: str, results: dict[str, dict], repeats: int, flops: list[float], peak: float | None
) -> dict[str, Any]:
    """The figures `report` prints, as one JSON-able dict (`--json`; `benchmarks.gpu_check`):
    per phase tokens/s and MFU (all measured steps and best-of-repeats), s/step and memory; the
    ratios; the publish figures."""
    rows = {name: result["steps"] for name, result in results.items()}
    mfu = lambda steps: None if peak is None else _rate(steps, "flops") / (peak * 1e12)  # noqa: E731
    phases = {
        name: {
            "response_tokens_per_step": statistics.mean(r["tokens"] for r in steps),
            "s_per_step": statistics.mean(r["step_s"] for r in steps),
            "tokens_per_s": _rate(steps),
            "best_tokens_per_s": _best_rate(steps, repeats),
            "mfu": mfu(steps),
            "best_mfu": mfu(_best(steps, repeats)),
            **{k: v for k, v in results[name].items() if k.startswith("mem_")},
        }
        for name, steps in rows.items()
    }
    best = {name: phase["best_tokens_per_s"] for name, phase in phases.items()}
    out: dict[str, Any] = {
        "device": device,
        "peak_tflops": peak,
        "phases": phases,
        "new_over_today": best["new"] / best["today"],
        "new_over_bare": best["new"] / best["bare"],
        "publish_bare": {k: results["bare"][k] for k in ("gather_s", "write_s", "bare_weights_MB")},
    }
    if "learner" in rows:
        steps = rows["learner"]
        uploads = [r for r in steps if "upload_s" in r]
        out["learner_over_bare"] = best["learner"] / best["bare"]
        out["learner_over_bare_all_steps"] = _rate(steps) / _rate(rows["bare"])
        out["publish_learner"] = {
            "sync_s": statistics.mean(r["sync_s"] for r in steps),
            "upload_s": statistics.mean(r["upload_s"] for r in uploads) if uploads else None,
            "stored_MB": statistics.mean(r["stored_bytes"] for r in uploads) / MB
            if uploads
            else None,
            "weights_MB": results["learner"]["weights_MB"],
        }
    return out


def report_learner(rows: dict[str, list], learner: dict[str, Any], best: dict[str, float]):
    """The learner against the bare step and the new path, and its publishes."""
    print(
        f"Learner.train_step / bare tokens/s: {best['learner'] / best['bare']:.3f} "
        f"best-of-repeats (goal ≥ 0.9), {_rate(rows['learner']) / _rate(rows['bare']):.3f} "
        f"over all measured steps; Learner.train_step / new-path step: "
        f"{best['learner'] / best['new']:.3f} best-of-repeats"
    )
    sync = statistics.mean(r["sync_s"] for r in rows["learner"])
    uploads = [r for r in rows["learner"] if "upload_s" in r]
    upload = (
        f"; background upload (perf/weight_upload_s, mean of {len(uploads)}): "
        f"{statistics.mean(r['upload_s'] for r in uploads):.3g} s for "
        f"{statistics.mean(r['stored_bytes'] for r in uploads) / MB:.0f} MB stored"
        if uploads
        else ""
    )
    publishing = learner["mem_publish_MB"]  # on a GPU, inside the step's peak
    memory = (
        ""
        if math.isnan(publishing)
        else f"; {learner['mem_kind']} peak while publishing {publishing:.0f} MB"
    )
    print(
        f"weight publish on the training path (perf/weight_sync_s, mean of "
        f"{len(rows['learner'])}): {sync:.3g} s; last version {learner['weights_MB']:.0f} MB"
        f"{upload}{memory}"
    )


def add_shape_arguments(parser: argparse.ArgumentParser, default_model: str) -> None:
    """The options `shape_overrides` reads: model, device, the batch's shape and activation
    checkpointing."""
    parser.add_argument("--model", choices=sorted(MODELS), default=default_model)
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu",
        help="learner.device; cuda also sets learner.mixed_precision=bf16",
    )  # fmt: skip
    parser.add_argument("--groups", type=int, default=4, help="B, groups per batch")
    parser.add_argument("--group-size", type=int, default=4, help="G, responses per group")
    parser.add_argument(
        "--prompt-len", type=int, nargs=2, default=[32, 64], metavar=("LOW", "HIGH"),
        help="prompt lengths, uniform in [LOW, HIGH]",
    )  # fmt: skip
    parser.add_argument("--min-response-len", type=int, default=32)
    parser.add_argument("--max-response-len", type=int, default=128)
    parser.add_argument(
        "--micro-batch-tokens", type=int,
        help="learner.micro_batch_tokens; default 1024 on cpu, 8192 on cuda, at least the longest "
        "sequence",
    )  # fmt: skip
    parser.add_argument(
        "--activation-checkpointing", action="store_true",
        help="learner.activation_checkpointing=true",
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_shape_arguments(parser, default_model="smollm2-135m-instruct")
    parser.add_argument(
        "--peak-tflops", type=float,
        help="peak FLOP/s (in TFLOP/s) for MFU; default: the GPU's dense bf16 peak by its name "
        "(H100 SXM, H200: 989); no MFU on CPU without it",
    )  # fmt: skip
    parser.add_argument("--warmup-steps", type=int, default=1, help="not measured")
    parser.add_argument("--batches", type=int, default=1, help="distinct measured batches")
    parser.add_argument("--repeats", type=int, default=3, help="measured steps per batch")
    parser.add_argument(
        "--phases", default="bare,today,new",
        help="comma-separated, of bare, today, new, learner (each a process alive for the whole "
        "run: mind the memory)",
    )  # fmt: skip
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument("--phase", choices=sorted(PHASES), help=argparse.SUPPRESS)
    parser.add_argument("--run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        _phase_main(args)
        return

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        phases = args.phases.split(",")
        if set(phases) - set(PHASES) or {"bare", "today", "new"} - set(phases):
            parser.error(f"--phases {args.phases}: bare, today and new, optionally learner")
        config, shape, flops = prepare_run(args, run_dir)
        cfg = config.learner
        print(
            f"model {args.model} (weights {config.model.dtype}, learner.device {cfg.device}, "
            f"mixed_precision {cfg.mixed_precision}, activation_checkpointing "
            f"{cfg.activation_checkpointing}), B={args.groups} groups × G={args.group_size}, "
            f"prompts {args.prompt_len[0]}–{args.prompt_len[1]} tokens, "
            f"responses {args.min_response_len}–{args.max_response_len} tokens, "
            f"micro_batch_tokens {cfg.micro_batch_tokens}; {args.warmup_steps} warm-up + "
            f"{args.batches} batch(es) × {args.repeats} measured steps per phase, "
            f"the processes in lockstep\n{shape.describe()}"
        )
        device, results = run_phases(run_dir, args.warmup_steps, len(flops), phases)
        peak = args.peak_tflops or default_peak_tflops(device)
        source = "--peak-tflops" if args.peak_tflops else "dense bf16 peak by the device's name"
        print(
            f"device: {device}; MFU against "
            + (f"{peak:g} TFLOP/s ({source})" if peak else "– (give --peak-tflops)")
        )
        report(results, args.repeats, flops, peak)
        if args.json:
            figures = summary(device, results, args.repeats, flops, peak)
            Path(args.json).write_text(figures_json(figures))


if __name__ == "__main__":
    main()
