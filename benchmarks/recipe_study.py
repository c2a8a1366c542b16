"""The calculator agent before and after each stage of its recipe, against the same recipe
without the tool (issue #47).

    .venv/bin/python -m benchmarks.recipe_study                          # both arms, seeds 0,1
    .venv/bin/python -m benchmarks.recipe_study --arms tool --seeds 2    # some cells
    .venv/bin/python -m benchmarks.recipe_study --report                 # the table only

Arms. `tool` is the bundled recipe `calculator-agent` as `make demo RECIPE=calculator-agent`
runs it: a supervised warm start on `builtin:calculator-demos` (the calculator in use, rendered
as the environment's episodes), then DAPO with the calculator environment on
`builtin:calculator` (arithmetic too large for a small model's head). `direct` is the same
recipe without the tool: the warm start on `builtin:calculator-answers` (the same problems, the
same final answers, no call), then DAPO single-turn with the math reward on the same problems,
with the same stage sizes and response budget. Only the recipe's run stages are run; this study
evaluates.

A cell is one arm × one seed: the recipe flow (`python -m flows.demo --recipe FILE`, the flow
the demo runs, on Prefect's temporary server) with `learner.seed`, `generator.seed` and
`data.shuffle_seed` set for every stage; timed from start to finish. After it, fresh evaluator
processes (`streamrl.evaluation.evaluator.Evaluator`, what `streamrl eval` runs) measure the
base model, the model after the warm start (the RL run's initial weights) and after RL (its last
version) under the RL run's settings — the environment and its tool for `tool`, single-turn for
`direct` — on the first `--eval-prompts` problems of `builtin:calculator-test`, which no stage
trains on: greedy accuracy, pass@1 of `--k` samples at the training temperature, and per
sampled episode the share that called the tool, tool calls, failed calls and turns.

Resumable. A finished cell writes `benchmarks/recipes/<cell>.json` and is not run again; an
interrupted one resumes its recipe (finished stages are skipped, the running one resumes from
its checkpoint; its wall-clock is then marked not comparable). The report — a table between
markers in `benchmarks/RESULTS.md` — is rewritten after every cell. A finished cell's weights
and checkpoints are deleted; metrics and logs stay in `--workdir`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.learning_study import run_child

ROOT = Path(__file__).resolve().parents[1]
CELLS_DIR = ROOT / "benchmarks" / "recipes"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
BEGIN, END = "<!-- recipe-study:begin -->", "<!-- recipe-study:end -->"
RECIPE = "calculator-agent"
ARMS = ("tool", "direct")
POINTS = ("base", "sft", "rl")  # the models evaluated, in the recipe's order
METRICS = ("val/acc_greedy", "val/pass@1", "val/tool_use_frac", "val/tool_calls_mean",
           "val/tool_errors_mean", "val/turns_mean", "val/response_len_mean")  # fmt: skip


def cell_name(arm: str, seed: int) -> str:
    return f"{arm}-s{seed}"


def recipe_file(arm: str, workdir: Path) -> Path:
    """The arm's recipe: the bundled one's run stages; for `direct`, without the tool."""
    from streamrl.config.loading import load_config
    from streamrl.recipes import load_recipe

    _, bundled = load_recipe(RECIPE)
    recipe = bundled.model_dump(mode="json")
    recipe["stages"] = [s for s in recipe["stages"] if s["kind"] == "run"]
    if arm == "direct":
        max_tokens = load_config(["smollm2-cpu", "calculator"]).generator.max_tokens
        for stage in recipe["stages"]:
            stage["presets"] = [p for p in stage["presets"] if p != "calculator"]
            stage["overrides"] = [
                _without_tool(o) for o in stage["overrides"] if not o.startswith("sft.tools=")
            ] + [f"generator.max_tokens={max_tokens}"]
    path = workdir / f"{RECIPE}-{arm}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def _without_tool(override: str) -> str:
    """Demonstrations of the tool become direct answers to the same problems."""
    return override.replace("builtin:calculator-demos", "builtin:calculator-answers")


def seed_overrides(seed: int) -> list[str]:
    return [f"learner.seed={seed}", f"generator.seed={seed}", f"data.shuffle_seed={seed}"]


def train(args: argparse.Namespace, arm: str, seed: int, root: Path) -> dict[str, Any]:
    """Run (or resume) the cell's recipe; when it first started and whether it resumed."""
    started_file = root.parent / f"{root.name}.started.json"
    resumed = started_file.exists()
    if not resumed:
        started_file.write_text(json.dumps({"time": time.time()}))
    started = json.loads(started_file.read_text())["time"]
    argv = [sys.executable, "-m", "flows.demo", "--recipe", str(recipe_file(arm, root.parent)),
            "--run-uri", str(root), *(["--resume"] if resumed else []),
            *seed_overrides(seed)]  # fmt: skip
    print(f"  $ {' '.join(argv[1:])}", flush=True)
    with (root.parent / f"{root.name}.out").open("a") as out:
        code = run_child(argv, out)
    if code != 0:
        raise SystemExit(f"{cell_name(arm, seed)}: the recipe exited {code}; see "
                         f"{root.parent / f'{root.name}.out'} and {root}/*/logs/")  # fmt: skip
    return {"started": started, "resumed": resumed, "finished": time.time()}


def evaluate(args: argparse.Namespace, root: Path) -> dict[str, dict[str, Any]]:
    """The three models, each point in a fresh evaluator process (one vLLM engine each)."""
    results: dict[str, dict[str, Any]] = {}
    for points in (["base"], ["sft", "rl"]):  # the base model needs its own engine
        out = root.parent / f"{root.name}.eval-{'-'.join(points)}.json"
        if not out.exists():
            argv = [sys.executable, "-m", "benchmarks.recipe_study", "--evaluate", str(root),
                    "--points", ",".join(points), "--k", str(args.k),
                    "--eval-prompts", str(args.eval_prompts), "--out", str(out)]  # fmt: skip
            log = root.parent / f"{root.name}.eval.out"
            with log.open("a") as stream:
                if run_child(argv, stream) != 0:
                    raise SystemExit(f"evaluating {root} failed; see {log}")
        results.update(json.loads(out.read_text()))
    return results


def evaluator_main(args: argparse.Namespace) -> None:
    """`--evaluate ROOT --points P,...`: the evaluator process."""
    from storage.fs import open_location
    from storage.weights.versions import WeightStore
    from streamrl.config.stored import load_run_config
    from streamrl.data.config import DataConfig
    from streamrl.evaluation.evaluator import Evaluator

    rl = open_location(str(Path(args.evaluate) / "rl"))
    config = load_run_config(rl)
    base = load_run_config(open_location(str(Path(args.evaluate) / "sft"))).model.path
    points = args.points.split(",")
    if points == ["base"]:
        config = config.model_copy(update={"model": config.model.model_copy(
            update={"path": base})})  # fmt: skip
    last = WeightStore(rl).latest_version()
    assert last is not None, "the RL stage published no version"
    versions = {"base": 0, "sft": 0, "rl": last}
    dataset = config.data.model_copy(update={"path": "builtin:calculator-test", "val_path": None})
    assert isinstance(dataset, DataConfig)
    results = {}
    with Evaluator(rl, config, dataset=dataset, k=args.k, max_prompts=args.eval_prompts) as ev:
        assert ev.held_out
        for point in points:
            started = time.perf_counter()
            metrics = ev.evaluate(versions[point])
            assert metrics is not None
            results[point] = {**ev.record(metrics), "eval_s": time.perf_counter() - started}
            print(point, json.dumps(results[point]), flush=True)
    Path(args.out).write_text(json.dumps(results))


def stage_summary(root: Path, stage: str) -> dict[str, Any]:
    """The stage's learner steps (first and last record) and its step count."""
    from storage.fs import open_location
    from streamrl.learner.reporting import read_metrics

    records = read_metrics(open_location(str(root / stage)))
    keep = ("step", "time", "loss", "heldout/loss", "rollout/acc", "rollout/tool_calls_mean",
            "rollout/turns_mean", "perf/step_s")  # fmt: skip
    return {"steps": [{k: r[k] for k in keep if k in r} for r in records]}


def run_cell(args: argparse.Namespace, arm: str, seed: int) -> None:
    name = cell_name(arm, seed)
    result_file = CELLS_DIR / f"{name}.json"
    if result_file.exists():
        print(f"{name}: done before ({result_file})")
        return
    root = Path(args.workdir).resolve() / name
    root.parent.mkdir(parents=True, exist_ok=True)
    CELLS_DIR.mkdir(parents=True, exist_ok=True)
    timing_file = root.parent / f"{name}.timing.json"
    if not timing_file.exists():
        print(f"{name}: the recipe in {root}", flush=True)
        timing_file.write_text(json.dumps(train(args, arm, seed, root)))
    timing = json.loads(timing_file.read_text())
    print(f"{name}: evaluating base, after SFT, after RL", flush=True)
    evaluations = evaluate(args, root)
    record = {
        "arm": arm,
        "seed": seed,
        "recipe": yaml.safe_load(recipe_file(arm, root.parent).read_text()),
        "seed_overrides": seed_overrides(seed),
        "wall_s": timing["finished"] - timing["started"],
        "wall_comparable": not timing["resumed"],
        "evaluations": evaluations,
        "stages": {stage: stage_summary(root, stage) for stage in ("sft", "rl")},
        "eval_prompts": args.eval_prompts,
        "k": args.k,
    }
    result_file.write_text(json.dumps(record, indent=1) + "\n")
    for stage in ("sft", "rl"):  # the evaluations are made: weights and checkpoints go
        for part in ("weights", "checkpoints"):
            shutil.rmtree(root / stage / part, ignore_errors=True)
    shutil.rmtree(root / "models", ignore_errors=True)
    print(f"{name}: done ({record['wall_s']:.0f} s)", flush=True)


def _mean_sd(values: list[float], digits: int = 3) -> str:
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def report_table(cells: list[dict[str, Any]]) -> str:
    """Per arm and model: the metrics as mean ± sample standard deviation over seeds."""
    lines = [
        "| arm | model | seeds | greedy | pass@1 | episodes calling the tool | tool calls "
        "| failed calls | turns | tokens |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in ARMS:
        mine = sorted((c for c in cells if c["arm"] == arm), key=lambda c: c["seed"])
        if not mine:
            continue
        for point, label in zip(POINTS, ("base", "after SFT", "after RL"), strict=True):
            row = [arm, label, ",".join(str(c["seed"]) for c in mine)]
            for metric in METRICS:
                values = [c["evaluations"][point].get(metric) for c in mine]
                digits = 1 if metric == "val/response_len_mean" else 3
                row.append("—" if None in values else _mean_sd([float(v) for v in values], digits))
            lines.append("| " + " | ".join(row) + " |")
    walls = [f"{c['arm']}-s{c['seed']} {c['wall_s']:.0f} s"
             + ("" if c["wall_comparable"] else " (resumed)") for c in cells]  # fmt: skip
    prompts = {(c["eval_prompts"], c["k"]) for c in cells}
    lines += ["", f"Held-out problems and samples per problem: {sorted(prompts)}. Recipe "
              f"wall-clock (SFT + RL, with their start-up): {', '.join(walls)}."]  # fmt: skip
    return "\n".join(lines)


def write_report() -> None:
    cells = [json.loads(p.read_text()) for p in sorted(CELLS_DIR.glob("*.json"))]
    text = RESULTS.read_text()
    if BEGIN not in text:
        raise SystemExit(f"{RESULTS} has no {BEGIN} … {END} markers for the table")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    RESULTS.write_text(f"{head}{BEGIN}\n{report_table(cells)}\n{END}{tail}")
    print(f"report: {len(cells)} cells → {RESULTS}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", default=",".join(ARMS), help=f"of {', '.join(ARMS)}")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--eval-prompts", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="samples per problem for pass@1")
    parser.add_argument("--workdir", default=str(ROOT / "runs" / "recipe-study"))
    parser.add_argument("--report", action="store_true", help="rewrite the table only")
    parser.add_argument("--evaluate", metavar="ROOT", help=argparse.SUPPRESS)
    parser.add_argument("--points", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.evaluate:
        evaluator_main(args)
        return
    if not args.report:
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        arms = args.arms.split(",")
        if unknown := sorted(set(arms) - set(ARMS)):
            parser.error(f"unknown arms {unknown}; choose from {', '.join(ARMS)}")
        for seed in (int(s) for s in args.seeds.split(",")):
            for arm in arms:
                run_cell(args, arm, seed)
                write_report()
        return
    write_report()


if __name__ == "__main__":
    main()
