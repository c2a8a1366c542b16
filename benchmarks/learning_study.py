"""Does it learn on problems it never trained on, and which algorithm learns best: a held-out
learning study across algorithms, seeds, and synchronous against asynchronous training.

    .venv/bin/python -m benchmarks.learning_study                      # the whole matrix
    .venv/bin/python -m benchmarks.learning_study --arms dapo,dapo_sync --seeds 0   # some cells
    .venv/bin/python -m benchmarks.learning_study --report             # table + figure only

Cells. One cell is one arm × one seed. The arms are algorithm presets with the demo's size
preset (`smollm2-cpu`: SmolLM2-135M-Instruct, fp32, the bundled arithmetic, G = 8 — VAPO's
preset G = 16 — 64 tokens, 4 groups per step) under the presets' own `max_staleness`
(asynchronous), and `dapo_sync`: DAPO with `learner.max_staleness=0` (synchronous: each
version's groups are sampled by that version). A seed sets `learner.seed`, `generator.seed` (the
engine's sampling) and `data.shuffle_seed` (prompt order).

A cell is a normal `streamrl run --generators 1` (placement plan, supervisor, flow control) of
`--steps` learner steps, every version kept (`weights.keep_versions`), no wandb. After it, one
evaluator process (`streamrl.evaluation.evaluator.Evaluator`, the code `streamrl eval` and the run's
evaluator use) loads the versions of `--eval-steps` one after the other and measures each on
`builtin:arithmetic-test` — facts no generator samples (`streamrl.data.builtin`) — with the
first `--eval-prompts` prompts: greedy accuracy, sampled pass@1 (mean accuracy of `--k` samples
per prompt at the training temperature) and the mean sampled response length. Step 0 is the
base model, measured once per seed (the first cell of that seed; the greedy part is the same
for every seed). Evaluating after the run rather than beside it keeps the timed run alone on
the machine's cores, so the wall-clock of asynchronous and synchronous training compare.

Resumable. Each finished cell writes `benchmarks/learning/<cell>.json` (and is never run
again); then the report is rewritten: the table in `benchmarks/LEARNING.md` between its markers
and the figure `benchmarks/learning.png`. A cell interrupted while training resumes from its
last checkpoint when run again (its wall-clock is then marked as not comparable); interrupted
while evaluating, it evaluates again. A finished cell's weights and checkpoints are deleted
(~0.5 GB per version); its metrics and logs stay in `--workdir`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
CELLS_DIR = ROOT / "benchmarks" / "learning"
STREAMRL = [sys.executable, "-m", "streamrl"]
SIZE = "smollm2-cpu"
ARMS: dict[str, tuple[str, list[str]]] = {  # arm: (algorithm preset, extra overrides)
    "grpo": ("grpo", []),
    "dr_grpo": ("dr_grpo", []),
    "dapo": ("dapo", []),
    "vapo": ("vapo", []),
    "dapo_sync": ("dapo", ["learner.max_staleness=0"]),
    "gspo": ("gspo", []),
    "cispo": ("cispo", []),
    "sapo": ("sapo", []),
    # On-policy distillation from the study's teacher (`make_teacher`): the demo model after a
    # DAPO run of the study's length, served by the run on its own (shared) core.
    "opd": ("opd", ["scorers.teacher.model={teacher}", "scorers.teacher.dtype=float32"]),
}
TEACHER_SEED = 1000  # the teacher's DAPO run: a seed no cell uses
# Versions an arm evaluates beyond --eval-steps: OPD's goal is judged within a third of the steps.
ARM_EVAL_STEPS: dict[str, tuple[int, ...]] = {"opd": (4, 10)}
STARTED = "study-started.json"  # in the run folder: when the cell's run was first launched


def cell_name(arm: str, seed: int) -> str:
    return f"{arm}-s{seed}"


def run_overrides(args: argparse.Namespace, arm: str, seed: int, run_dir: Path) -> list[str]:
    return [
        f"storage.run_uri={run_dir}",
        f"learner.total_steps={args.steps}",
        f"learner.seed={seed}",
        f"generator.seed={seed}",
        f"data.shuffle_seed={seed}",
        f"weights.keep_versions={args.steps + 1}",  # every version, for the evaluation after
        "eval.every_versions=0",
        "logging.wandb_mode=disabled",
        *(o.format(teacher=teacher_dir(args)) for o in ARMS[arm][1]),
    ]


def shown(args: argparse.Namespace, command: str) -> str:
    """`command` as the results show it: the work folder as the default's relative path."""
    return command.replace(str(Path(args.workdir).resolve()), "./runs/learning-study")


def teacher_dir(args: argparse.Namespace) -> Path:
    """Where the study's teacher is exported (`make_teacher`)."""
    return Path(args.workdir).resolve() / "teacher"


def make_teacher(args: argparse.Namespace) -> Path:
    """The teacher of the `opd` arm, made once: DAPO from the base model for `--steps` steps
    (seed `TEACHER_SEED`), its last version exported in float32, its held-out accuracy recorded
    in `benchmarks/learning/teacher.json`."""
    out = teacher_dir(args)
    record = CELLS_DIR / "teacher.json"
    if (out / "config.json").exists() and record.exists():
        return out
    run_dir = Path(args.workdir).resolve() / "teacher-run"
    print(f"teacher: DAPO for {args.steps} steps in {run_dir}", flush=True)
    if not (run_dir / "metrics" / "learner.jsonl").exists() or (
        learner_summary(run_dir)["steps"][-1]["step"] != args.steps
    ):
        train(args, "dapo", TEACHER_SEED, run_dir)
    evaluation = evaluate_versions(args, run_dir, [args.steps])
    argv = [*STREAMRL, "export", str(run_dir), "--version", str(args.steps), "--out", str(out),
            "--overwrite", "--dtype", "float32"]  # fmt: skip
    with (run_dir.parent / "teacher.export.out").open("w") as log:
        if run_child(argv, log) != 0:
            raise SystemExit(f"exporting the teacher failed; see {log.name}")
    for folder in ("weights", "checkpoints"):  # every version is kept for evaluation: ~18 GB
        shutil.rmtree(run_dir / folder, ignore_errors=True)
    record.write_text(json.dumps({
        "command": shown(args, shlex.join(["streamrl", "run", "--preset", "dapo", "--preset",
                                           SIZE, *run_overrides(args, "dapo", TEACHER_SEED,
                                                                run_dir)])),
        "evaluation": evaluation[0],
    }, indent=1) + "\n")  # fmt: skip
    return out


def train(args: argparse.Namespace, arm: str, seed: int, run_dir: Path) -> dict[str, Any]:
    """Run (or resume) the cell's training; when it was first started and whether it resumed."""
    preset = ARMS[arm][0]
    argv = [*STREAMRL, "run", "--preset", preset, "--preset", SIZE, "--generators", "1"]
    argv += run_overrides(args, arm, seed, run_dir)
    started_file = run_dir.parent / f"{run_dir.name}.{STARTED}"
    resumed = started_file.exists()
    if not resumed:
        started_file.write_text(json.dumps({"time": time.time()}))
    started = json.loads(started_file.read_text())["time"]
    if resumed and (run_dir / "run.json").exists():
        argv.insert(argv.index("run") + 1, "--resume")
    print(f"  $ {shlex.join(['streamrl', *argv[3:]])}", flush=True)
    log = run_dir.parent / f"{run_dir.name}.out"
    with log.open("a") as out:
        code = run_child(argv, out)
    if code != 0:
        raise SystemExit(f"{cell_name(arm, seed)}: streamrl run exited {code}; "
                         f"see {log} and {run_dir}/logs/")  # fmt: skip
    return {"started": started, "resumed": resumed}


def run_child(argv: list[str], log: IO[str]) -> int:
    """Run `argv` with its output in `log`; its exit code. On Ctrl-C (which the child, in the
    terminal's process group, receives too) wait for the child to stop its own processes and
    leave its checkpoint rather than kill it, as `subprocess.run` would."""
    process = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        return process.wait()
    except KeyboardInterrupt:
        print("  interrupted: waiting for it to stop (Ctrl-C again to stop waiting)", flush=True)
        process.wait()
        raise


def evaluate_versions(
    args: argparse.Namespace, run_dir: Path, versions: list[int]
) -> list[dict[str, Any]]:
    """Evaluate `versions` of the run in a fresh interpreter (one vLLM engine for all); an
    earlier evaluation of the same versions is reused."""
    out = run_dir.parent / f"{run_dir.name}.eval.json"
    if out.exists() and sorted(e["version"] for e in json.loads(out.read_text())) == versions:
        return json.loads(out.read_text())
    argv = [sys.executable, "-m", "benchmarks.learning_study", "--evaluate", str(run_dir),
            "--versions", ",".join(map(str, versions)), "--k", str(args.k),
            "--eval-prompts", str(args.eval_prompts)]  # fmt: skip
    log = run_dir.parent / f"{run_dir.name}.eval.out"
    with log.open("w") as stream:
        code = run_child([*argv, "--out", str(out)], stream)
    if code != 0:
        raise SystemExit(f"evaluating {run_dir} exited {code}; see {log}")
    return json.loads(out.read_text())


def evaluator_main(args: argparse.Namespace) -> None:
    """`--evaluate RUN_DIR`: the evaluator process."""
    from storage.fs import open_location
    from streamrl.config.stored import load_run_config
    from streamrl.data.config import DataConfig
    from streamrl.evaluation.evaluator import Evaluator

    run = open_location(args.evaluate)
    config = load_run_config(run)
    dataset = config.data.model_copy(update={"path": "builtin:arithmetic-test", "val_path": None})
    assert isinstance(dataset, DataConfig)
    results = []
    with Evaluator(run, config, dataset=dataset, k=args.k, max_prompts=args.eval_prompts) as ev:
        assert ev.held_out
        for version in sorted(int(v) for v in args.versions.split(",")):
            started = time.perf_counter()
            metrics = ev.evaluate(version)
            assert metrics is not None
            results.append({**ev.record(metrics), "eval_s": time.perf_counter() - started})
            print(json.dumps(results[-1]), flush=True)
    Path(args.out).write_text(json.dumps(results))


def add_evaluations(args: argparse.Namespace, cell: str, run_dir: str) -> None:
    """`--add-evaluations CELL RUN_DIR`: versions a cell did not evaluate (an arm's evaluation
    steps grew after it ran), evaluated as `run_cell` would from the run's kept weights and
    added to its record with `evaluated_after` naming them."""
    record_file = CELLS_DIR / f"{cell}.json"
    record = json.loads(record_file.read_text())
    versions = sorted(int(v) for v in args.versions.split(","))
    done = {e["version"] for e in record["evaluations"]}
    new = [v for v in versions if v not in done]
    if not new:
        print(f"{cell}: versions {versions} are evaluated already")
        return
    added = evaluate_versions(args, Path(run_dir).resolve(), new)
    record["evaluations"] = sorted([*record["evaluations"], *added], key=lambda e: e["version"])
    record["evaluated_after"] = sorted({*record.get("evaluated_after", ()), *new})
    record_file.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{cell}: added versions {new}")


def learner_summary(run_dir: Path) -> dict[str, Any]:
    """Per step: what the report needs from the learner's metrics records."""
    from storage.fs import open_location
    from streamrl.learner.metrics_records import read_metrics

    keep = ("step", "time", "policy_version", "perf/step_s", "perf/wait_s", "stream/consumed",
            "stream/accepted", "stream/dropped_stale", "stream/dropped_zero_var",
            "rollout/acc", "rollout/response_len_mean", "rollout/truncated_frac",
            "generators/paused_s_total", "critic/explained_var", "stream/staleness_mean",
            "actor/entropy", "actor/ref_kl", "actor/clip_frac", "actor/gate_weight_mean",
            "actor/is_weight_mean", "opd/reverse_kl", "opd/teacher_logp_mean",
            "rollout/teacher_s_per_group")  # fmt: skip
    records = read_metrics(open_location(str(run_dir)))
    pretrain = [r for r in records if "value_pretrain_step" in r]  # VAPO's critic-only steps
    return {
        "steps": [{k: r[k] for k in keep if k in r} for r in records if r not in pretrain],
        "value_pretrain": [
            {k: r[k] for k in ("value_pretrain_step", "time", "critic/explained_var")}
            for r in pretrain
        ],
    }


def run_cell(args: argparse.Namespace, arm: str, seed: int) -> None:
    name = cell_name(arm, seed)
    result_file = CELLS_DIR / f"{name}.json"
    if result_file.exists():
        print(f"{name}: done before ({result_file})")
        return
    run_dir = Path(args.workdir).resolve() / name
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    CELLS_DIR.mkdir(parents=True, exist_ok=True)
    print(f"{name}: training {args.steps} steps in {run_dir}", flush=True)
    learner = learner_summary(run_dir) if (run_dir / "run.json").exists() else {"steps": []}
    if learner["steps"] and learner["steps"][-1]["step"] == args.steps:  # evaluation failed
        timing = json.loads((run_dir.parent / f"{name}.timing.json").read_text())
    else:
        timing = train(args, arm, seed, run_dir)
        (run_dir.parent / f"{name}.timing.json").write_text(json.dumps(timing))
        learner = learner_summary(run_dir)
    last = learner["steps"][-1]
    if last["step"] != args.steps:
        raise SystemExit(f"{name}: the run stopped at step {last['step']}, not {args.steps}")
    base_file = CELLS_DIR / f"base-s{seed}.json"
    versions = sorted({s for s in (*args.eval_steps, *ARM_EVAL_STEPS.get(arm, ())) if s > 0})
    versions = versions if base_file.exists() else [0, *versions]
    print(f"{name}: evaluating versions {versions}", flush=True)
    evaluations = evaluate_versions(args, run_dir, versions)
    if not base_file.exists():
        base = [e for e in evaluations if e["version"] == 0]
        base_file.write_text(json.dumps({"seed": seed, "evaluations": base}, indent=1) + "\n")
    result = {
        "cell": name,
        "arm": arm,
        "seed": seed,
        "steps": args.steps,
        "command": shlex.join(["streamrl", "run", "--preset", ARMS[arm][0], "--preset", SIZE,
                               "--generators", "1", *run_overrides(args, arm, seed, run_dir)]),
        "wall_s": last["time"] - timing["started"],  # launch to the final step's record
        "resumed": timing["resumed"],
        "evaluations": [e for e in evaluations if e["version"] > 0],
        **learner,
    }  # fmt: skip
    result["command"] = shown(args, result["command"])
    result_file.write_text(json.dumps(result, indent=1) + "\n")
    for folder in ("weights", "checkpoints"):
        shutil.rmtree(run_dir / folder, ignore_errors=True)
    print(f"{name}: done in {result['wall_s']:.0f}s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", default=",".join(ARMS), help=f"of {', '.join(ARMS)}")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--eval-steps", default="0,8,16,32")
    parser.add_argument("--eval-prompts", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="samples per prompt for pass@1")
    parser.add_argument("--workdir", default=str(ROOT / "runs" / "learning-study"))
    parser.add_argument("--report", action="store_true", help="rewrite the report only")
    parser.add_argument("--evaluate", metavar="RUN_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--versions", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument(
        "--add-evaluations",
        nargs=2,
        metavar=("CELL", "RUN_DIR"),
        help="evaluate --versions of RUN_DIR (a finished cell's run with its weights kept) and "
        "add them to the cell's record, marked as evaluated after it finished",
    )
    args = parser.parse_args()
    if args.evaluate:
        evaluator_main(args)
        return
    if args.add_evaluations:
        add_evaluations(args, *args.add_evaluations)
        return
    if not args.report:
        args.eval_steps = [int(s) for s in args.eval_steps.split(",")]
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        seeds = [int(s) for s in args.seeds.split(",")]
        arms = args.arms.split(",")
        unknown = sorted(set(arms) - set(ARMS))
        if unknown:
            parser.error(f"unknown arms {unknown}; choose from {', '.join(ARMS)}")
        if "opd" in arms:
            make_teacher(args)
        for seed in seeds:  # seed-major: every arm has a seed early
            for arm in arms:
                run_cell(args, arm, seed)
                report()
        return
    from benchmarks.learning_report import write_report

    write_report(CELLS_DIR)


def report() -> None:
    """Rewrite the report in a fresh interpreter (so it runs the report code as it is now)."""
    argv = [sys.executable, "-m", "benchmarks.learning_study", "--report"]
    if subprocess.run(argv, cwd=ROOT, check=False).returncode != 0:
        print("the report failed (see above); the cells are kept: rerun with --report")


if __name__ == "__main__":
    main()
