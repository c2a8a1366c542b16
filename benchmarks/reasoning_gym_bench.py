"""Which reasoning-gym tasks the demo model can learn: the base model's held-out pass rate per
task, measured the way `streamrl eval` measures (`streamrl.evaluation.evaluator.Evaluator`:
the run's engine settings, the reward in its workers, the tasks' held-out split).

    .venv/bin/python -m benchmarks.reasoning_gym_bench                  # the candidates below
    .venv/bin/python -m benchmarks.reasoning_gym_bench --prompts 48 --k 8 --preset reasoning-gym
    .venv/bin/python -m benchmarks.reasoning_gym_bench --learn --seeds 0,1 --steps 32

A task is a good RL task for a model when its pass rate starts between ~0.1 and ~0.6 (mixed
groups: DAPO's dynamic sampling keeps them). The candidates are easy settings of tasks
SmolLM2-135M-Instruct might answer; the printed table (pass@1 over k samples at the training
temperature, greedy accuracy, response length) chooses the demo's mixture
(`streamrl/presets/reasoning-gym.yaml`).

`--learn`: does the demo learn its mixture? Per seed, a `streamrl run` of the demo's presets
(`dapo`, `smollm2-cpu`, `reasoning-gym`; learner, generator and shuffle seeds set to the seed)
for `--steps` steps, then one evaluator process measures version 0 and the last version on the
mixture's held-out split (`--eval-prompts` per task, `--k` samples): pass@1 per task before and
after, per seed, and whether every task improved by more than the seeds' spread (the spread of
the after values; the mean gain, and the least seed's gain, against it). A seed's result
is kept in `benchmarks/reasoning_gym/<seed>.json` and not run again; its run stays in
`--workdir` (weights of the versions between are not kept).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from streamrl.config.loading import load_config
from streamrl.config.stored import prepare_run
from streamrl.evaluation.evaluator import Evaluator

CANDIDATES: dict[str, dict[str, Any]] = {
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                         "operators": ["+", "-", "*"], "allow_negation": False,
                         "allow_parentheses": False},
    "chain_sum": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1},
    "products": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    "leg_counting": {"min_animals": 1, "max_animals": 2, "max_instances": 3},
    "letter_counting": {"min_words": 3, "max_words": 5},
    "gcd": {"max_value": 20},
    "base_conversion": {"max_base": 10, "max_value": 16},
    "spell_backward": {"min_word_len": 3, "max_word_len": 4},
}  # fmt: skip


def measure(
    tasks: dict[str, dict[str, Any]], prompts: int, k: int, presets: list[str], extra: list[str]
) -> dict[str, Any]:
    """The base model's per-task metrics on the held-out split (`prompts` per task)."""
    settings = {name: {"config": config} for name, config in tasks.items()}
    overrides = [
        f"data.path=reasoning_gym:{','.join(tasks)}",
        f"data.reasoning_gym.tasks={settings}",
        f"data.reasoning_gym.eval_size={prompts}",
        "generator.reward.fn=reasoning_gym",
        "data.val_path=null",
        *extra,
    ]
    with tempfile.TemporaryDirectory(prefix="rg-bench-") as root:
        overrides.append(f"storage.run_uri={root}/run")
        config, run = prepare_run(load_config(presets, overrides=overrides))
        evaluator = Evaluator(run, config, k=k, max_prompts=prompts * len(tasks))
        with evaluator:
            return evaluator.evaluate(0) or {}


ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "reasoning_gym"
LEARN_PRESETS = ("dapo", "smollm2-cpu", "reasoning-gym")


def learn(args: argparse.Namespace) -> None:
    """`--learn` (module docstring): train and evaluate each seed, then the table."""
    seeds = [int(s) for s in args.seeds.split(",")]
    for seed in seeds:
        out = RESULTS / f"s{seed}.json"
        if out.exists():
            print(f"seed {seed}: done before ({out})")
            continue
        run_dir = Path(args.workdir).resolve() / f"rg-dapo-s{seed}"
        overrides = [
            f"storage.run_uri={run_dir}", f"learner.total_steps={args.steps}",
            f"learner.seed={seed}", f"generator.seed={seed}", f"data.shuffle_seed={seed}",
            f"weights.keep_versions={args.steps + 1}", "eval.every_versions=0",
            "logging.wandb_mode=disabled",
        ]  # fmt: skip
        argv = [sys.executable, "-m", "streamrl", "run", "--generators", "1"]
        argv += [f"--preset={p}" for p in LEARN_PRESETS]
        if (run_dir / "run.json").exists():
            argv.append("--resume")
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with (run_dir.parent / f"{run_dir.name}.out").open("a") as log:
            print(f"seed {seed}: training {args.steps} steps in {run_dir}", flush=True)
            if subprocess.run([*argv, *overrides], cwd=ROOT, stdout=log, stderr=log).returncode:
                raise SystemExit(f"seed {seed}: the run failed; see {log.name}")
            train_s = time.monotonic() - started
            print(f"seed {seed}: evaluating versions 0 and {args.steps}", flush=True)
            evaluate = [sys.executable, "-m", "benchmarks.reasoning_gym_bench", "--evaluate",
                        str(run_dir), "--versions", f"0,{args.steps}", "--k", str(args.k),
                        "--prompts", str(args.prompts)]  # fmt: skip
            result = subprocess.run(evaluate, cwd=ROOT, stdout=subprocess.PIPE, stderr=log)
        if result.returncode:
            raise SystemExit(f"seed {seed}: the evaluation failed; see {log.name}")
        evaluations = json.loads(result.stdout.decode().strip().splitlines()[-1])
        RESULTS.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "seed": seed, "steps": args.steps, "train_s": train_s,
            "command": " ".join(["streamrl", "run", "--generators", "1",
                                 *(f"--preset={p}" for p in LEARN_PRESETS), *overrides[1:]]),
            "evaluations": evaluations,
        }, indent=1) + "\n")  # fmt: skip
        for folder in ("weights", "checkpoints"):
            subprocess.run(["rm", "-rf", str(run_dir / folder)], check=False)
    learning_table(seeds)


def evaluate_run(args: argparse.Namespace) -> None:
    """`--evaluate RUN_DIR`: versions of a run on its held-out split, as JSON on stdout."""
    from storage.fs import open_location
    from streamrl.config.stored import load_run_config

    run = open_location(args.evaluate)
    config = load_run_config(run)
    tasks = len(config.data.path.split(","))
    results = []
    with Evaluator(run, config, k=args.k, max_prompts=args.prompts * tasks) as evaluator:
        assert evaluator.held_out
        for version in (int(v) for v in args.versions.split(",")):
            metrics = evaluator.evaluate(version)
            assert metrics is not None
            results.append(evaluator.record(metrics))
    print(json.dumps(results))


def learning_table(seeds: list[int]) -> None:
    """Held-out pass@1 per task before and after, per seed, and the verdict."""
    cells = [json.loads((RESULTS / f"s{s}.json").read_text()) for s in seeds]
    tasks = sorted({
        key.split("/")[1] for c in cells for e in c["evaluations"] for key in e
        if key.startswith("val/") and key.endswith("/pass@1") and key.count("/") == 2
    })  # fmt: skip
    print(f"\n{'task':<18}" + "".join(f"{'seed ' + str(c['seed']):>22}" for c in cells)
          + f"{'gain (mean)':>14}{'least gain':>12}{'seed spread':>13}")  # fmt: skip
    beyond_mean, beyond_each = [], []
    for task in tasks:
        row, gains, afters = f"{task:<18}", [], []
        for c in cells:
            before, after = (e[f"val/{task}/pass@1"] for e in c["evaluations"])
            row += f"{before:>10.3f} → {after:<9.3f}"
            gains.append(after - before)
            afters.append(after)
        # Compared at the printed precision: a tie is not an improvement beyond the spread.
        spread = round(max(afters) - min(afters), 3)
        mean, least = round(sum(gains) / len(gains), 3), round(min(gains), 3)
        beyond_mean.append(mean > spread)
        beyond_each.append(least > spread)
        print(f"{row}{mean:>+14.3f}{least:>+12.3f}{spread:>13.3f}")
    print(f"every task's mean gain beyond the seeds' spread: {all(beyond_mean)}")
    print(f"every seed's gain on every task beyond it: {all(beyond_each)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32, help="held-out prompts per task")
    parser.add_argument("--k", type=int, default=8, help="samples per prompt")
    parser.add_argument("--tasks", default=",".join(CANDIDATES), help="candidates to measure")
    parser.add_argument("--preset", action="append", default=None, help="presets (repeatable)")
    parser.add_argument("--set", action="append", default=[], help="dotted overrides")
    parser.add_argument("--learn", action="store_true", help="train and evaluate the demo")
    parser.add_argument("--seeds", default="0,1", help="--learn: the seeds")
    parser.add_argument("--steps", type=int, default=32, help="--learn: learner steps")
    parser.add_argument("--workdir", default=str(ROOT / "runs" / "reasoning-gym-study"))
    parser.add_argument("--evaluate", metavar="RUN_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--versions", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.evaluate:
        return evaluate_run(args)
    if args.learn:
        return learn(args)
    presets = args.preset or ["dapo", "smollm2-cpu"]
    tasks = {name: CANDIDATES.get(name, {}) for name in args.tasks.split(",")}
    started = time.monotonic()
    metrics = measure(tasks, args.prompts, args.k, presets, args.set)
    print(f"\n{'task':<18}{'pass@1':>8}{'greedy':>8}{'prompts':>9}   settings")
    for name, config in tasks.items():
        pass1 = metrics.get(f"val/{name}/pass@1", float("nan"))
        greedy = metrics.get(f"val/{name}/acc_greedy", float("nan"))
        count = metrics.get(f"val/{name}/num_prompts", 0)
        print(f"{name:<18}{pass1:>8.3f}{greedy:>8.3f}{count:>9.0f}   {config}")
    print(
        f"\nall: pass@1 {metrics.get('val/pass@1', float('nan')):.3f}, response length "
        f"{metrics.get('val/response_len_mean', float('nan')):.0f} tokens; presets {presets}, "
        f"k={args.k}, {time.monotonic() - started:.0f}s"
    )


if __name__ == "__main__":
    main()
