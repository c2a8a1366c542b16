"""Learner throughput: the learner's step on today's path and on the fast one, against a bare
forward + backward + AdamW step of the same model, plus `Learner.train_step()` itself, peak
memory and weight publish time.

    .venv/bin/python -m benchmarks.learner_bench [--model smollm2-135m-instruct] [--repeats 3]
    .venv/bin/python -m benchmarks.learner_bench --group-size 8 --prompt-len 64 76 \
        --min-response-len 16 --max-response-len 64          # the demo's shapes
    .venv/bin/python -m benchmarks.learner_bench --groups 2 --group-size 8 \
        --prompt-len 512 512 --max-response-len 128          # a long shared prompt

One run directory holds a replay stream of synthetic DAPO groups (policy version 0, varied
response lengths, rewards with variance so dynamic sampling keeps every group): `--batches`
distinct batches of B groups, each written `--repeats` times in a row, after one warm-up copy
of the first. The phases read it, each in its own process so that their memory peaks do not
mix (`--phases`; every phase process lives for the whole run, so mind the machine's memory):

- *learner*: `Learner(config, run, topology).train_step()`, which reads a batch from the stream,
  builds micro-batches, trains (DAPO loss, entropy metric, gradient clipping, metrics
  all-reduce) and publishes the full weights. Its time is the learner's own `perf/step_s`
  (everything but the publish); the publish's time on the training path (the snapshot of the
  shard; the upload runs in the background) is its `perf/weight_sync_s`.
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
from streamrl.learner.forward import use_hidden_states_head
from streamrl.learner.loop import Learner
from streamrl.learner.model import full_state_dict, load_policy, shard_model
from streamrl.learner.optim import build_optimizer
from streamrl.learner.step import StepModels, StepSettings, Trainable, train_on_batch
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
            f"data.max_prompt_len={args.prompt_len[1]}",
            f"model.max_model_len={max(2048, args.prompt_len[1] + args.max_response_len)}",
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


def prepare_run(args: argparse.Namespace, run_dir: str) -> RunConfig:
    """Create the run (run.json) and write its stream, one segment per step: the first batch
    for each warm-up step, then each of the distinct batches `repeats` times."""
    config = bench_config(args, run_dir)
    run = open_location(run_dir)
    create_run(run, config.model_dump(mode="json"))
    vocab = AutoConfig.from_pretrained(resolve_model_path(config.model.path)).vocab_size
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
            "weights_MB": manifest.stored_bytes / MB,
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

    shared_prompt = False  # a row per response

    def __init__(self, config: RunConfig, run: Location, model: torch.nn.Module | None = None):
        cfg = config.learner
        self.config, self.run = config, run
        self.sampler = RssSampler()
        self.topology = Topology.from_env(cfg.device)
        model = model if model is not None else load_policy(config.model.path, config.model)
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
        """The next B stream groups as micro-batches (untimed), then the timed `train`."""
        cfg = self.config.learner
        train = TrainBatch.from_groups([next(self.groups) for _ in range(cfg.batch_groups)])
        minis = make_mini_batches(
            train,
            cfg.mini_batch_groups,
            cfg.micro_batch_tokens,
            overlong_filter=self.config.algorithm.overlong.filter,
            shared_prompt=self.shared_prompt,
        )
        started = time.perf_counter()
        extra = self.train(train, minis)
        step_s = time.perf_counter() - started
        self.windows.append((started, started + step_s))
        forward = sum(m.input_ids.numel() for mini in minis for m in mini.micro_batches)
        tokens = sum(m.num_loss_tokens for m in minis)
        return {"tokens": tokens, "step_s": step_s, "forward_tokens": forward, **extra}

    def train(self, train: TrainBatch, minis: list[MiniBatch]) -> dict[str, Any]:
        bare_step(self.model, self.optimizer, minis)
        return {}

    def finish(self, warmup: int) -> dict[str, Any]:
        # The one-process publish path, in its two parts: gather the full weights, then write
        # a version (serialise + xxh3 checksums + write + manifest + LATEST).
        started = time.perf_counter()
        state = full_state_dict(self.model, self.topology)
        gather_s = time.perf_counter() - started
        started = time.perf_counter()
        store = WeightStore(self.run.child("bare"))
        store.publish(1, state, shard_bytes=self.config.weights.shard_bytes)
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
        self.sampler.stop()
        self.topology.destroy()
        return {
            "rss_setup_MB": self.rss_setup / MB,
            "rss_train_MB": self.sampler.peak(self.windows[warmup:]) / MB,
            "rss_high_water_MB": _high_water_mb(),
        }


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


def run_phases(run_dir: str, warmup: int, steps: int, phases: list[str]) -> dict[str, dict]:
    """The `phases`, step k of each right after step k of the others (the order rotates);
    each result holds its measured `steps` rows and its `finish` figures."""
    procs = [PhaseProcess(name, run_dir) for name in phases]
    try:
        for proc in procs:
            proc.ask()  # set up
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
    return results


# -- report --------------------------------------------------------------------------------


def _rate(rows: list[dict]) -> float:
    return sum(r["tokens"] for r in rows) / sum(r["step_s"] for r in rows)


def _best_rate(rows: list[dict], repeats: int) -> float:
    """Tokens/s with each batch's fastest repeat."""
    batches = [rows[i : i + repeats] for i in range(0, len(rows), repeats)]
    best = [min(batch, key=lambda r: r["step_s"]) for batch in batches]
    return _rate(best)


def report(results: dict[str, dict], repeats: int) -> None:
    rows = {name: result["steps"] for name, result in results.items()}
    if len({tuple(r["tokens"] for r in steps) for steps in rows.values()}) != 1:
        raise RuntimeError("the phases trained on different loss tokens; not comparable")
    tokens = statistics.mean(r["tokens"] for r in rows["bare"])
    print("\n| phase | response tokens/step | forward tokens/step | s/step | tokens/s | "
          "best-of tokens/s | RSS setup MB | RSS peak train MB | RSS high-water MB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    names = {
        "bare": "bare fwd+bwd+AdamW (a row per response)",
        "today": "learner step, today's path",
        "new": "learner step, shared prompts + response-only head",
        "learner": "Learner.train_step (new path, + stream, publish)",
    }
    for name, result in results.items():
        steps = result["steps"]
        forward = statistics.mean(r.get("forward_tokens", float("nan")) for r in steps)
        print(
            f"| {names[name]} | {tokens:.0f} | {forward:.0f} | "
            f"{statistics.mean(r['step_s'] for r in steps):.3g} | {_rate(steps):.1f} | "
            f"{_best_rate(steps, repeats):.1f} | {result['rss_setup_MB']:.0f} | "
            f"{result['rss_train_MB']:.0f} | {result['rss_high_water_MB']:.0f} |"
        )
    speedup = _best_rate(rows["new"], repeats) / _best_rate(rows["today"], repeats)
    print(
        f"\nnew / today response tokens/s: {speedup:.2f}× best-of-repeats (goal ≥ 2×), "
        f"{_rate(rows['new']) / _rate(rows['today']):.2f}× over all measured steps; "
        f"new / bare {_best_rate(rows['new'], repeats) / _best_rate(rows['bare'], repeats):.2f}×"
    )
    losses = [(a["loss"], b["loss"]) for a, b in zip(rows["today"], rows["new"], strict=True)]
    print(f"policy loss, today vs new (first measured step): {losses[0][0]:.6f} vs "
          f"{losses[0][1]:.6f} (later steps diverge only by float rounding)")  # fmt: skip
    if "learner" not in results:
        return
    bare, learner = results["bare"], results["learner"]
    best = _best_rate(rows["learner"], repeats) / _best_rate(rows["new"], repeats)
    print(f"Learner.train_step / new-path step tokens/s: {best:.3f} best-of-repeats")
    sync = statistics.mean(r["sync_s"] for r in rows["learner"])
    print(
        f"weight publish (perf/weight_sync_s, mean of {len(rows['learner'])}): {sync:.3g} s for "
        f"{learner['weights_MB']:.0f} MB; on the bare phase's model: full_state_dict "
        f"{bare['gather_s']:.3g} s + WeightStore.publish {bare['write_s']:.3g} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=sorted(SIZE_PRESETS), default="smollm2-135m-instruct")
    parser.add_argument("--groups", type=int, default=4, help="B, groups per batch")
    parser.add_argument("--group-size", type=int, default=4, help="G, responses per group")
    parser.add_argument(
        "--prompt-len", type=int, nargs=2, default=[32, 64], metavar=("LOW", "HIGH"),
        help="prompt lengths, uniform in [LOW, HIGH]",
    )  # fmt: skip
    parser.add_argument("--min-response-len", type=int, default=32)
    parser.add_argument("--max-response-len", type=int, default=128)
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    parser.add_argument("--warmup-steps", type=int, default=1, help="not measured")
    parser.add_argument("--batches", type=int, default=1, help="distinct measured batches")
    parser.add_argument("--repeats", type=int, default=3, help="measured steps per batch")
    parser.add_argument(
        "--phases", default="bare,today,new",
        help="comma-separated, of bare, today, new, learner (each a process alive for the whole "
        "run: mind the memory)",
    )  # fmt: skip
    parser.add_argument("--phase", choices=sorted(PHASES), help=argparse.SUPPRESS)
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
            f"prompts {args.prompt_len[0]}–{args.prompt_len[1]} tokens, "
            f"responses {args.min_response_len}–{args.max_response_len} tokens, "
            f"micro_batch_tokens {args.micro_batch_tokens}; {args.warmup_steps} warm-up + "
            f"{args.batches} batch(es) × {args.repeats} measured steps per phase, "
            "the processes in lockstep"
        )
        steps = args.batches * args.repeats
        phases = args.phases.split(",")
        if set(phases) - set(PHASES) or {"bare", "today", "new"} - set(phases):
            parser.error(f"--phases {args.phases}: bare, today and new, optionally learner")
        report(run_phases(run_dir, args.warmup_steps, steps, phases), args.repeats)


if __name__ == "__main__":
    main()
