"""Learner throughput: `Learner.train_step()` against a bare forward + backward + AdamW step of
the same model on the same micro-batches, plus peak memory and weight publish time.

    .venv/bin/python -m benchmarks.learner_bench [--model smollm2-135m-instruct] [--repeats 3]

One run directory holds a replay stream of synthetic DAPO groups (policy version 0, varied
response lengths, rewards with variance so dynamic sampling keeps every group): `--batches`
distinct batches of B groups, each written `--repeats` times in a row, after one warm-up copy
of the first. Two phases read it, each in its own process so that their memory peaks do not
mix:

- *learner*: `Learner(config, run, topology).train_step()`, which reads a batch from the stream,
  builds micro-batches, trains (DAPO loss, entropy metric, gradient clipping, metrics
  all-reduce) and publishes the full weights. Its time is the learner's own `perf/step_s`
  (everything but the publish); the publish is its `perf/weight_sync_s`.
- *bare*: the same FSDP2-wrapped model and AdamW settings on the micro-batches rebuilt from the
  same groups in the same order (`TrainBatch.from_groups` + `make_mini_batches`, outside the
  timed region): forward, a log-softmax-gather loss on the targets, backward, optimiser step.

The parent runs the two processes in lockstep: step k of one right after step k of the other
(on the same batch), so that both see the same machine load. Both count loss tokens
(`loss_mask`) per second after the warm-up steps: over all measured steps, and best-of-repeats
(each batch's fastest step, the least disturbed on a shared machine). Memory is the
resident set size (RSS, Linux `/proc`): sampled every 5 ms and split into training and
publishing windows, and the process's exact high-water mark (`ru_maxrss`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig

from storage.fs import Location, open_location
from storage.manifest import create_run, open_run
from storage.records import ScoredGroup
from storage.stream import StreamReader, StreamWriter
from storage.weights import WeightStore
from streamrl.config import RunConfig, load_config, validate_config
from streamrl.learner.batching import MiniBatch, TrainBatch, make_mini_batches
from streamrl.learner.loop import Learner
from streamrl.learner.model import full_state_dict, load_policy, shard_model
from streamrl.learner.optim import build_optimizer
from streamrl.learner.topology import Topology
from streamrl.models import resolve_model_path

ROOT = Path(__file__).resolve().parents[1]
MB = 1e6
SIZE_PRESETS = {"smollm2-135m-instruct": "smollm2-cpu", "tiny-qwen2": "tiny-cpu"}


# -- the run: config and a synthetic stream ------------------------------------------------


def bench_config(args: argparse.Namespace, run_dir: str) -> RunConfig:
    """DAPO with the model's CPU size preset, resized to the benchmark's batch. No checkpoints
    and no staleness drops: every measured step trains on the next B groups of the stream."""
    return load_config(
        ["dapo", SIZE_PRESETS[args.model]],
        overrides=[
            f"storage.run_uri={run_dir}",
            f"generator.group_size={args.group_size}",
            f"generator.max_tokens={args.max_response_len}",
            f"learner.batch_groups={args.groups}",
            f"learner.mini_batch_groups={args.groups}",
            f"learner.micro_batch_tokens={args.micro_batch_tokens}",
            f"learner.total_steps={args.warmup_steps + args.batches * args.repeats + 1}",
            "learner.warmup_steps=0",
            "learner.publish_every=1",
            "learner.checkpoint_every=1000000",
            "learner.max_staleness=1000000",
            "learner.device=cpu",
        ],
    )


def synthetic_groups(
    count: int, group_size: int, min_len: int, max_len: int, vocab: int, seed: int = 0
) -> list[ScoredGroup]:
    """`count` groups of 32–64-token prompts and `min_len`–`max_len`-token responses (uniform;
    those of `max_len` count as truncated), half of each group rewarded +1 and half −1."""
    rng = np.random.default_rng(seed)
    groups = []
    for i in range(count):
        lengths = rng.integers(min_len, max_len + 1, size=group_size)
        truncated = lengths == max_len
        correct = rng.permutation(np.arange(group_size) < group_size // 2)
        prompt_len = int(rng.integers(32, 65))
        now = time.time()
        groups.append(
            ScoredGroup(
                prompt_id=f"p{i}",
                prompt_tokens=rng.integers(0, vocab, size=prompt_len, dtype=np.int32),
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


def prepare_run(args: argparse.Namespace, run_dir: str) -> RunConfig:
    """Create the run (run.json) and write its stream, one segment per step: the first batch
    for each warm-up step, then each of the distinct batches `repeats` times."""
    config = bench_config(args, run_dir)
    run = open_location(run_dir)
    create_run(run, config.model_dump(mode="json"))
    vocab = AutoConfig.from_pretrained(resolve_model_path(config.model.path)).vocab_size
    B = args.groups
    groups = synthetic_groups(
        B * args.batches, args.group_size, args.min_response_len, args.max_response_len, vocab
    )
    batches = [groups[b * B : (b + 1) * B] for b in range(args.batches)]
    writer = StreamWriter(run, "bench")
    measured = [batch for batch in batches for _ in range(args.repeats)]
    for batch in [batches[0]] * args.warmup_steps + measured:
        writer.write(batch)
    return config


# -- memory ----------------------------------------------------------------------------------


class RssSampler:
    """This process's RSS every `interval_s` (from `/proc/self/statm`) in a daemon thread;
    `peak(windows)` is the largest sample taken inside any of the `(start, end)` windows."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        with open("/proc/self/statm") as statm:
            while not self._stop.is_set():
                statm.seek(0)
                self.samples.append((time.perf_counter(), int(statm.read().split()[1]) * page))
                self._stop.wait(self.interval_s)

    def now(self) -> int:
        time.sleep(2 * self.interval_s)
        return self.samples[-1][1]

    def peak(self, windows: list[tuple[float, float]]) -> int:
        inside = [rss for t, rss in self.samples if any(a <= t <= b for a, b in windows)]
        return max(inside, default=0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _high_water_mb() -> float:
    """The process's peak RSS since it started (`ru_maxrss` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB


# -- the two phases (each in a child process) ----------------------------------------------


class LearnerPhase:
    """`Learner.train_step()`; per step the learner's own figures (its metrics)."""

    def __init__(self, config: RunConfig, run: Location) -> None:
        self.config, self.run = config, run
        self.sampler = RssSampler()
        self.topology = Topology.from_env(config.learner.device)
        self.learner = Learner(config, run, self.topology)
        self.rss_setup = self.sampler.now()
        self.train_windows: list[tuple[float, float]] = []
        self.publish_windows: list[tuple[float, float]] = []

    def step(self) -> dict[str, Any]:
        started = time.perf_counter()
        metrics = self.learner.train_step()
        wall_s = time.perf_counter() - started
        if metrics["stream/consumed"] != self.config.learner.batch_groups:
            raise RuntimeError(f"a step skipped stream groups, so the phases differ: {metrics}")
        step_s, sync_s = metrics["perf/step_s"], metrics["perf/weight_sync_s"]
        self.train_windows.append((started, started + step_s))
        self.publish_windows.append((started + step_s, started + step_s + sync_s))
        tokens = round(metrics["perf/learner_tokens_per_s"] * (step_s - metrics["perf/wait_s"]))
        return {"tokens": tokens, "step_s": step_s, "sync_s": sync_s, "wall_s": wall_s}

    def finish(self, warmup: int) -> dict[str, Any]:
        store = WeightStore(self.run)
        manifest = store.read_manifest(store.latest_version())
        self.sampler.stop()
        self.topology.destroy()
        return {
            "weights_MB": sum(s.size for s in manifest.shards) / MB,
            "rss_setup_MB": self.rss_setup / MB,
            "rss_train_MB": self.sampler.peak(self.train_windows[warmup:]) / MB,
            "rss_publish_MB": self.sampler.peak(self.publish_windows[warmup:]) / MB,
            "rss_high_water_MB": _high_water_mb(),
        }


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
    """The same model, optimiser settings and micro-batches (built here, untimed), trained by
    `bare_step`, one batch of B stream groups per step in stream order."""

    def __init__(self, config: RunConfig, run: Location) -> None:
        cfg = config.learner
        self.config, self.run = config, run
        self.sampler = RssSampler()
        self.topology = Topology.from_env(cfg.device)
        model = load_policy(config.model.path, config.model)
        self.model = shard_model(
            model, self.topology, cfg.mixed_precision, cfg.activation_checkpointing
        )
        self.optimizer = build_optimizer(
            self.model.parameters(), cfg.lr, cfg.weight_decay, cfg.betas, cfg.eps
        )
        self.groups = StreamReader(run).groups(timeout_s=60)
        self.rss_setup = self.sampler.now()
        self.windows: list[tuple[float, float]] = []

    def step(self) -> dict[str, Any]:
        cfg = self.config.learner
        train = TrainBatch.from_groups([next(self.groups) for _ in range(cfg.batch_groups)])
        minis = make_mini_batches(
            train,
            cfg.mini_batch_groups,
            cfg.micro_batch_tokens,
            overlong_filter=self.config.algorithm.overlong.filter,
        )
        started = time.perf_counter()
        bare_step(self.model, self.optimizer, minis)
        step_s = time.perf_counter() - started
        self.windows.append((started, started + step_s))
        return {"tokens": sum(m.num_loss_tokens for m in minis), "step_s": step_s}

    def finish(self, warmup: int) -> dict[str, Any]:
        # What the learner's publish does, in its two parts: gather the full weights, then
        # write a version (serialise + sha256 + write + manifest + LATEST).
        started = time.perf_counter()
        state = full_state_dict(self.model, self.topology)
        gather_s = time.perf_counter() - started
        started = time.perf_counter()
        store = WeightStore(self.run.child("bare"))
        store.publish(1, state, shard_bytes=self.config.storage.weight_shard_bytes)
        write_s = time.perf_counter() - started
        self.groups.close()
        self.sampler.stop()
        self.topology.destroy()
        return {
            "gather_s": gather_s,
            "write_s": write_s,
            "rss_setup_MB": self.rss_setup / MB,
            "rss_train_MB": self.sampler.peak(self.windows[warmup:]) / MB,
            "rss_high_water_MB": _high_water_mb(),
        }


# The parent drives both children in lockstep over their stdin/stdout, one step at a time, so
# that each pair of steps on the same batch runs back to back under the same machine load.
REPLY = "@learner_bench "


def _phase_main(args: argparse.Namespace) -> None:  # pragma: no cover - a child process
    run = open_location(args.run)
    config = validate_config(open_run(run).config, source=f"{args.run}/run.json")
    phase = (LearnerPhase if args.phase == "learner" else BarePhase)(config, run)
    reply = lambda obj: print(REPLY + json.dumps(obj), flush=True)  # noqa: E731
    reply({"ready": True})
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


def run_phases(run_dir: str, warmup: int, steps: int) -> tuple[dict, dict]:
    """Both phases, step k of one right after step k of the other (which goes first
    alternates); each result holds its measured `steps` rows and its `finish` figures."""
    bare, learner = PhaseProcess("bare", run_dir), PhaseProcess("learner", run_dir)
    try:
        bare.ask(), learner.ask()  # both set up
        rows: dict[str, list] = {"bare": [], "learner": []}
        for k in range(warmup + steps):
            for proc in (bare, learner) if k % 2 == 0 else (learner, bare):
                rows[proc.phase].append(proc.ask("step"))
        results = []
        for proc in (bare, learner):
            results.append({"steps": rows[proc.phase][warmup:]} | proc.ask(f"finish {warmup}"))
    finally:
        bare.close()
        learner.close()
    return results[0], results[1]


# -- report --------------------------------------------------------------------------------


def _rate(rows: list[dict]) -> float:
    return sum(r["tokens"] for r in rows) / sum(r["step_s"] for r in rows)


def _best_rate(rows: list[dict], repeats: int) -> float:
    """Tokens/s with each batch's fastest repeat."""
    batches = [rows[i : i + repeats] for i in range(0, len(rows), repeats)]
    best = [min(batch, key=lambda r: r["step_s"]) for batch in batches]
    return _rate(best)


def report(bare: dict, learner: dict, repeats: int) -> None:
    b_rows, l_rows = bare["steps"], learner["steps"]
    if [r["tokens"] for r in b_rows] != [r["tokens"] for r in l_rows]:
        raise RuntimeError("the phases trained on different loss tokens; not comparable")
    tokens = statistics.mean(r["tokens"] for r in b_rows)
    print("\n| phase | loss_tokens/step | s/step | tokens/s | best-of tokens/s | RSS setup MB | "
          "RSS peak train MB | RSS peak publish MB | RSS high-water MB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name, result, publish in (
        ("bare fwd+bwd+AdamW", bare, "–"),
        ("Learner.train_step", learner, f"{learner['rss_publish_MB']:.0f}"),
    ):
        rows = result["steps"]
        print(
            f"| {name} | {tokens:.0f} | {statistics.mean(r['step_s'] for r in rows):.3g} | "
            f"{_rate(rows):.1f} | {_best_rate(rows, repeats):.1f} | "
            f"{result['rss_setup_MB']:.0f} | {result['rss_train_MB']:.0f} | "
            f"{publish} | {result['rss_high_water_MB']:.0f} |"
        )
    ratio = _rate(l_rows) / _rate(b_rows)
    best = _best_rate(l_rows, repeats) / _best_rate(b_rows, repeats)
    per_step = [b["step_s"] / lr["step_s"] for b, lr in zip(b_rows, l_rows, strict=True)]
    print(
        f"\nlearner / bare tokens/s: {best:.3f} best-of-repeats, overhead {1 / best - 1:+.1%} "
        f"of the bare step time (goal ≤ +10%); {ratio:.3f} over all measured steps "
        f"(per step: {', '.join(f'{r:.3f}' for r in per_step)})"
    )
    sync = statistics.mean(r["sync_s"] for r in l_rows)
    wall = statistics.mean(r["wall_s"] - r["step_s"] - r["sync_s"] for r in l_rows)
    print(
        f"weight publish (perf/weight_sync_s, mean of {len(l_rows)}): {sync:.3g} s for "
        f"{learner['weights_MB']:.0f} MB ({learner['weights_MB'] / sync:.0f} MB/s); "
        f"the same in parts, on the bare phase's model: full_state_dict {bare['gather_s']:.3g} s "
        f"+ WeightStore.publish {bare['write_s']:.3g} s"
    )
    print(f"train_step outside step_s and publish (metrics log): {wall * 1000:.1f} ms/step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=sorted(SIZE_PRESETS), default="smollm2-135m-instruct")
    parser.add_argument("--groups", type=int, default=4, help="B, groups per batch")
    parser.add_argument("--group-size", type=int, default=4, help="G, responses per group")
    parser.add_argument("--min-response-len", type=int, default=32)
    parser.add_argument("--max-response-len", type=int, default=128)
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    parser.add_argument("--warmup-steps", type=int, default=1, help="not measured")
    parser.add_argument("--batches", type=int, default=1, help="distinct measured batches")
    parser.add_argument("--repeats", type=int, default=3, help="measured steps per batch")
    parser.add_argument("--phase", choices=["learner", "bare"], help=argparse.SUPPRESS)
    parser.add_argument("--run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        _phase_main(args)
        return

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        config = prepare_run(args, run_dir)
        print(
            f"model {args.model} ({config.model.dtype}, {config.learner.device}, "
            f"{torch.get_num_threads()} threads), B={args.groups} groups × G={args.group_size}, "
            f"responses {args.min_response_len}–{args.max_response_len} tokens, "
            f"micro_batch_tokens {args.micro_batch_tokens}; {args.warmup_steps} warm-up + "
            f"{args.batches} batch(es) × {args.repeats} measured steps per phase, "
            "the two processes in lockstep"
        )
        steps = args.batches * args.repeats
        bare, learner = run_phases(run_dir, args.warmup_steps, steps)
        report(bare, learner, args.repeats)


if __name__ == "__main__":
    main()
