"""streamrl against TRL's GRPOTrainer on the same CPU task, both measured in one invocation:
seconds per steady step and the whole run's wall time.

    .venv/bin/python -m benchmarks.trl_bench           # 4 steps of 8 prompts × 8, ≤ 128 tokens
    .venv/bin/python -m benchmarks.trl_bench --trl-venv runs/trl-venv         # TRL kept apart
    .venv/bin/python -m benchmarks.trl_bench --steps 2 --prompts 2 --samples 4 --max-tokens 16
                                                                              # a smoke run

TRL is an optional dependency, `pip install 'streamrl[trl-bench]'`, which brings datasets and
pandas 3 along; `--trl-venv DIR` keeps them out of streamrl's environment: the TRL side runs
from a virtualenv created on first use as an overlay of this one (its own packages first, then
this interpreter's, so torch, transformers and streamrl are shared) holding the extra's TRL.

The task is streamrl's demo (`--preset dapo --preset smollm2-cpu`): SmolLM2-135M-Instruct fp32
on `builtin:arithmetic`, each step `--prompts` prompts × `--samples` samples of at most
`--max-tokens` tokens (`learner.batch_groups`, `generator.group_size`, `generator.max_tokens`),
T = 1, lr 1e-5, seeds fixed (`--seed`); on CPU, every core this process may use, one side after
the other (`--parts trl,streamrl`).

*TRL* — `trl.GRPOTrainer` in a subprocess (`--trl-worker`), configured from the same streamrl
configuration: the dataset's `PromptSource` chat messages in its first epoch's order (TRL renders
them with the same chat template); the configuration's reward function (math-verify), scaled and
overlong-shaped as a streamrl generator shapes it (`algorithm.reward_scale`, `.overlong`);
transformers generation (`use_vllm=False`); one optimiser step over prompts × samples completions
(generated in one batch, the loss taken a group at a time);
DAPO's settings where TRL has them (`loss_type="dapo"`, `beta=0`, `epsilon` / `epsilon_high`
0.2 / 0.28, group-std advantages); `learner.*`'s AdamW and warm-up; no evaluation, no saving, a
log line a step; OpenMP threads = the cores with the sleeping waits streamrl's processes get
(`loop_bench.start_placed`). A step: between consecutive `on_step_end` callbacks (the first from
`on_train_begin`), generating, scoring and training.

*streamrl-split* — the same with the placement before issue #61 (`learner.cpu_cores` = half
the cores: the learner alone on them, the generator alone on the rest), for the before/after.

*streamrl* — `streamrl run --preset dapo --preset smollm2-cpu --generators 1` as loop_bench
starts it (`streamrl_run`: no evaluator, wandb off, only the final checkpoint). A step is
`perf/step_s + perf/weight_sync_s` of the learner's record (`loop_bench.learner_figures`):
collecting the batch (waiting for the generator included), training and publishing weights.

What differs is the designs: streamrl generates with vLLM on the learner's cores at background
priority while the learner trains (the placement plan), up to 4 versions stale; DAPO's dynamic
sampling trains each step on `--prompts` groups with mixed rewards, so it may generate more (the
table gives the groups consumed per step); its whole run includes its final checkpoint. TRL has
no dynamic sampling, dual clip or importance correction for transformers generation.

Whole run: from spawning the side's process to its exit (model load included). Cores busy
(streamrl): the learner's and the generator's CPU seconds from their own metrics over the wall
time × cores, after the first step (`loop_bench.cpu_figures`). Steady step: the
mean over the steps after the first. Response tokens: the mean sampled length over those steps.
Goals (issue #61): streamrl / TRL ≤ 0.4 per steady step, ≤ 0.6 for the whole run. Records:
`<workdir>/trl.json`, `<workdir>/streamrl.json`, `<workdir>/streamrl-split.json` and the
comparison `<workdir>/trl_bench.json` (default workdir ./runs/trl-bench); with `--parts` naming
one side, the other's record of an earlier invocation in the same workdir is reused if it has
the same shape, and the table says so.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
import tomllib
import venv
from pathlib import Path
from typing import Any

from benchmarks.loop_bench import ROOT, learner_figures, start_placed, streamrl_run, wait_ok
from streamrl.placement import ProcessPlacement, machine_cpus

PRESETS = ["dapo", "smollm2-cpu"]
EXTRA = "trl-bench"
GOALS = {"steady_step": 0.4, "whole_run": 0.6}
SIDES = ("trl", "streamrl", "streamrl-split")
NAMES = {
    "trl": "TRL GRPOTrainer",
    "streamrl": "streamrl",
    "streamrl-split": "streamrl, cores split (before #61)",
}
SHAPE_FLAGS = ("steps", "prompts", "samples", "max_tokens", "seed")  # passed to the TRL worker
_VERSION = "import importlib.metadata as m; print(m.version('trl'))"


# -- the shape both sides run ----------------------------------------------------------------


def shape(args: argparse.Namespace) -> dict[str, Any]:
    """What a side's figures depend on; a side's record is reused only for the same shape."""
    return {
        "presets": PRESETS,
        "steps": args.steps,
        "prompts": args.prompts,
        "samples": args.samples,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "cores": len(machine_cpus()),
    }


def shape_overrides(args: argparse.Namespace) -> list[str]:
    """The streamrl overrides both sides' configuration is loaded with."""
    return [
        f"learner.batch_groups={args.prompts}",
        f"learner.mini_batch_groups={args.prompts}",
        f"generator.group_size={args.samples}",
        f"generator.max_tokens={args.max_tokens}",
        f"generator.seed={args.seed}",
        f"learner.seed={args.seed}",
        f"data.shuffle_seed={args.seed}",
    ]


def side_record(
    args: argparse.Namespace, steps_s: list[float], wall_s: float, **extra: Any
) -> dict[str, Any]:
    """A side's record: its shape, each step's seconds, the steady mean, the whole-run wall."""
    return {
        "shape": shape(args),
        "steps_s": steps_s,
        "steady_s": statistics.mean(steps_s[1:]),
        "wall_s": wall_s,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **extra,
    }


# -- TRL -------------------------------------------------------------------------------------


def trl_requirements() -> list[str]:
    """The `trl-bench` extra of streamrl's pyproject.toml: the TRL version this benchmark runs."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["optional-dependencies"][EXTRA]


def overlay_venv(where: Path) -> str:
    """The Python of a virtualenv at `where` that sees this interpreter's packages after its
    own, created with the `trl-bench` extra installed when it is not there yet."""
    python = where / "bin" / "python"
    if not python.is_file():
        venv.EnvBuilder(with_pip=True).create(where)
        # Its own setuptools would shadow (and pip would then upgrade) the one vLLM pins.
        subprocess.run([str(python), "-m", "pip", "uninstall", "-qy", "setuptools"], check=True)
        own = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        shared = sysconfig.get_paths()["purelib"]
        Path(own, "streamrl-base.pth").write_text(f"import site; site.addsitedir({shared!r})\n")
        subprocess.run([str(python), "-m", "pip", "install", *trl_requirements()], check=True)
    return str(python)


def trl_python(args: argparse.Namespace) -> tuple[str, str]:
    """(the TRL side's interpreter, its TRL version); exits naming the fix when it has none."""
    python = sys.executable
    if args.trl_venv is not None:
        python = overlay_venv(Path(args.trl_venv).resolve())
    found = subprocess.run([python, "-c", _VERSION], capture_output=True, text=True, check=False)
    if found.returncode != 0 and args.trl_venv is not None:
        sys.exit(f"trl is not installed in {args.trl_venv}: remove it and rerun to create it")
    if found.returncode != 0:
        sys.exit(
            f"trl is not installed for {python}: pip install 'streamrl[{EXTRA}]', or pass "
            "--trl-venv DIR to run TRL from a virtualenv of its own (created on first use)"
        )
    return python, found.stdout.strip()


def trl_part(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """TRL's side: the worker in a subprocess, timed from spawn to exit."""
    python, version = trl_python(args)
    out_dir, log = work / "trl-run", work / "trl.out"
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    argv = [python, "-m", "benchmarks.trl_bench", "--trl-worker", str(out_dir / "steps.json")]
    argv += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in SHAPE_FLAGS]
    cpus = tuple(machine_cpus())  # threads and waits as streamrl's placed processes get them
    placement = ProcessPlacement(name="trl", component="learner", cpus=cpus, threads=len(cpus))
    print(f"TRL {version} GRPOTrainer ...\n  $ {' '.join(argv[1:])}  (log: {log})", flush=True)
    started = time.monotonic()
    wait_ok(start_placed(argv, placement, log), log, "the TRL side", args.timeout_s)
    wall_s = time.monotonic() - started
    worker = json.loads((out_dir / "steps.json").read_text())
    print(f"  done in {wall_s:.0f}s", flush=True)
    return side_record(args, worker["steps_s"], wall_s, version=version, **worker["extra"])


def trl_worker(args: argparse.Namespace) -> None:
    """The TRL side's process: train `args.steps` GRPO steps, write each step's seconds."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from streamrl.config.loading import load_config
    from streamrl.data.datasets import PromptSource
    from streamrl.models import resolve_model_path

    config = load_config(PRESETS, overrides=shape_overrides(args))
    source = PromptSource(config.data, config.model.path)
    prompts = [source.prompts[i] for i in source.epoch_order(0)]
    dataset = Dataset.from_list(
        [{"prompt": list(p.messages), "ground_truth": p.ground_truth} for p in prompts]
    )

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_begin(self, *_: Any, **__: Any) -> None:
            self.ends.append(time.monotonic())

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.ends.append(time.monotonic())

    learner, generator, clip = config.learner, config.generator, config.algorithm.policy_loss
    training = GRPOConfig(
        output_dir=str(Path(args.trl_worker).parent),
        max_steps=args.steps,
        # One optimiser step over prompts × samples completions, generated in one batch
        # (generation_batch_size), the loss taken a group at a time: one forward and backward
        # of all 64 at once takes more than 24 GiB here (fp32 logits over the whole vocabulary).
        per_device_train_batch_size=args.samples,
        gradient_accumulation_steps=args.prompts,
        num_generations=args.samples,
        max_completion_length=args.max_tokens,
        temperature=generator.temperature,
        top_p=generator.top_p,
        use_vllm=False,
        loss_type="dapo",
        beta=0.0,
        epsilon=clip.clip_low,
        epsilon_high=clip.clip_high,
        scale_rewards="group",
        learning_rate=learner.lr,
        lr_scheduler_type="constant_with_warmup",  # smollm2-cpu: constant after the warm-up
        warmup_steps=learner.warmup_steps,
        weight_decay=learner.weight_decay,
        adam_beta1=learner.betas[0],
        adam_beta2=learner.betas[1],
        adam_epsilon=learner.eps,
        max_grad_norm=learner.grad_clip or 0.0,
        gradient_checkpointing=learner.activation_checkpointing,
        model_init_kwargs={"dtype": "float32"},
        bf16=False,
        use_cpu=True,
        shuffle_dataset=False,  # the prompts in streamrl's first-epoch order
        seed=args.seed,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=resolve_model_path(config.model.path),
        reward_funcs=streamrl_reward(config),
        args=training,
        train_dataset=dataset,
        callbacks=[timer],
    )
    trainer.train()
    lengths = [r["completions/mean_length"] for r in trainer.state.log_history if "loss" in r]
    steps_s = [b - a for a, b in zip(timer.ends, timer.ends[1:], strict=False)]
    extra = {"response_len": statistics.mean(lengths[1:]) if len(lengths) > 1 else None}
    Path(args.trl_worker).write_text(json.dumps({"steps_s": steps_s, "extra": extra}))


def streamrl_reward(config: Any) -> Any:
    """The configuration's reward as a TRL reward function: each completion scored by the
    reward function, mapped to the rule reward and overlong-shaped as a generator does
    (`streamrl.generator.records`)."""
    import torch

    from streamrl.algorithms.shaping import overlong_penalty, scale_rule_reward
    from streamrl.rewards.registry import resolve_reward

    score = resolve_reward(config.generator.reward.spec())
    algorithm = config.algorithm

    def streamrl_reward(completions, completion_ids, ground_truth, **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        raw = torch.tensor([float(score(t, g)) for t, g in zip(texts, ground_truth, strict=True)])
        rewards = scale_rule_reward(raw, algorithm.reward_scale)
        if algorithm.overlong.shaping:
            lengths = torch.tensor([len(ids) for ids in completion_ids])
            max_len = config.generator.max_tokens
            rewards = rewards + overlong_penalty(lengths, max_len, config.overlong_cache_len)
        return rewards.tolist()

    return streamrl_reward


# -- streamrl --------------------------------------------------------------------------------


def streamrl_part(args: argparse.Namespace, work: Path, split: bool = False) -> dict[str, Any]:
    """streamrl's side: `streamrl run` as loop_bench starts it, timed from spawn to exit.
    `split`: the placement before issue #61, the learner alone on the first half of the cores
    and the generator alone on the rest (`learner.cpu_cores`), for the before/after."""
    run_dir = work / ("streamrl-split-run" if split else "streamrl-run")
    shutil.rmtree(run_dir, ignore_errors=True)
    cores = [f"learner.cpu_cores={max(1, len(machine_cpus()) // 2)}"] if split else []
    bench = argparse.Namespace(
        size="smollm2-cpu",
        steps=args.steps,
        override=[*shape_overrides(args), *cores],
        timeout_s=args.timeout_s,
    )
    print(f"{NAMES['streamrl-split' if split else 'streamrl']} run ...", flush=True)
    started = time.monotonic()
    streamrl_run(bench, run_dir)
    wall_s = time.monotonic() - started
    print(f"  done in {wall_s:.0f}s", flush=True)
    fig = learner_figures(run_dir)
    extra = {"consumed_groups": fig["consumed_list"], "response_len": fig["response_len"]}
    extra |= {k: fig[k] for k in ("cpu_busy", "cpu_learner", "cpu_generators") if k in fig}
    return side_record(args, fig["steps_s"], wall_s, **extra)


# -- report ----------------------------------------------------------------------------------


def compare(trl: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    """streamrl / TRL per steady step and for the whole run, each against its goal."""
    ratios = {
        "steady_step": ours["steady_s"] / trl["steady_s"],
        "whole_run": ours["wall_s"] / trl["wall_s"],
    }
    return {
        "ratios": ratios,
        "goals": GOALS,
        "met": {name: ratios[name] <= goal for name, goal in GOALS.items()},
    }


def table(records: dict[str, dict[str, Any]], reused: dict[str, str]) -> list[str]:
    """The report's lines: each side's steps, steady mean and wall, then the ratios."""
    steps = max(len(r["steps_s"]) for r in records.values())
    head = " | ".join(f"step {i + 1}" for i in range(steps))
    lines = [
        f"| side | {head} | steady mean (s/step) | whole run (s) | response tokens |",
        "|---|" + "---|" * (steps + 3),
    ]
    for side, rec in records.items():
        name = NAMES[side]
        label = f"{name} {rec.get('version', '')}".strip()
        if side in reused:
            label += f" (earlier run, {reused[side]})"
        cells = " | ".join(f"{s:.1f}" for s in rec["steps_s"])
        tokens = "–" if rec.get("response_len") is None else f"{rec['response_len']:.1f}"
        lines.append(
            f"| {label} | {cells} | {rec['steady_s']:.1f} | {rec['wall_s']:.0f} | {tokens} |"
        )
    for side in ("streamrl", "streamrl-split"):
        if side not in records:
            continue
        result = compare(records["trl"], records[side])
        for name, what in (("steady_step", "steady step"), ("whole_run", "whole run")):
            ratio, goal = result["ratios"][name], GOALS[name]
            verdict = "met" if result["met"][name] else "not met"
            lines.append(f"{side} / TRL, {what}: {ratio:.3f} (goal ≤ {goal}: {verdict})")
        if (busy := records[side].get("cpu_busy")) is not None:
            lines.append(
                f"{side} cores busy after the first step: {busy:.0%} (learner "
                f"{records[side]['cpu_learner']:.0%}, generator "
                f"{records[side]['cpu_generators']:.0%}; goal ≥ 85%)"
            )
        if consumed := records[side].get("consumed_groups"):
            lines.append(f"{side} groups consumed per step after the first (dynamic sampling "
                         f"rejects included): {consumed}")  # fmt: skip
    return lines


def load_earlier(work: Path, side: str, args: argparse.Namespace) -> dict[str, Any]:
    """The side's record of an earlier invocation in `work`; exits when it is missing or was
    measured on another shape."""
    path = work / f"{side}.json"
    if not path.is_file():
        sys.exit(f"no earlier {side} record in {work}: run with --parts {side} first")
    record = json.loads(path.read_text())
    if record["shape"] != shape(args):
        sys.exit(
            f"{path} was measured with {record['shape']}, not {shape(args)}: rerun --parts "
            f"{side} or pass the same --steps/--prompts/--samples/--max-tokens/--seed"
        )
    return record


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=4, help="steps per side (the first warms up)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts (groups) per step")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per sample, at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--parts",
        default="trl,streamrl,streamrl-split",
        help="comma-separated: trl, streamrl, streamrl-split (the cores split, before #61)",
    )
    parser.add_argument("--workdir", default="runs/trl-bench", help="records and logs go here")
    parser.add_argument("--trl-venv", help="run TRL from this virtualenv (created if missing)")
    parser.add_argument("--timeout-s", type=float, default=3600, help="limit per side")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)  # the TRL side's process
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(args)
        return
    parts = args.parts.split(",")
    if not set(parts) <= set(SIDES) or args.steps < 2 or min(args.prompts, args.samples) < 2:
        parser.error(
            "--parts takes trl, streamrl, streamrl-split; --steps, --prompts, --samples ≥ 2"
        )

    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    print(f"{args.steps} steps of {args.prompts} prompts × {args.samples} samples, ≤ "
          f"{args.max_tokens} tokens, {shape(args)['cores']} cores; records in {work}",
          flush=True)  # fmt: skip
    records, reused = {}, {}
    for side in SIDES:
        if side in parts:
            if side == "trl":
                records[side] = trl_part(args, work)
            else:
                records[side] = streamrl_part(args, work, split=side == "streamrl-split")
            (work / f"{side}.json").write_text(json.dumps(records[side], indent=2) + "\n")
        elif side != "streamrl-split" or (work / f"{side}.json").is_file():
            records[side] = load_earlier(work, side, args)
            reused[side] = records[side]["finished_at"]
    print("\n" + "\n".join(table(records, reused)))
    compared = {
        side: compare(records["trl"], records[side])
        for side in ("streamrl", "streamrl-split")
        if side in records
    }
    summary = {**records, "compared": compared, "reused": reused}
    (work / "trl_bench.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
