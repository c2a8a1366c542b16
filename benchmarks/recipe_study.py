"""A bundled recipe before and after each of its stages, against the same recipe changed in one
way (the studies: `benchmarks.recipe_studies`).

    .venv/bin/python -m benchmarks.recipe_study                           # calculator, seeds 0,1
    .venv/bin/python -m benchmarks.recipe_study --study preference        # sft-dpo-rl ± DPO
    .venv/bin/python -m benchmarks.recipe_study --arms tool --seeds 2     # some cells
    .venv/bin/python -m benchmarks.recipe_study --study preference --report  # the tables only

A cell is one arm × one seed: the recipe flow (`python -m flows.demo --recipe FILE`, the flow
the demo runs, on Prefect's temporary server) on the arm's run stages, with `learner.seed`,
`generator.seed` and `data.shuffle_seed` set for every stage; timed from start to finish. After
it, fresh evaluator processes (`streamrl.evaluation.evaluator.Evaluator`, what `streamrl eval`
runs) measure the arm's models (`Point`: the base model, once per seed, a stage's exported
model, the RL stage's first and last version) under the RL stage's settings on the first
`--eval-prompts` problems of the study's held-out set, which no stage trains on: greedy
accuracy, pass@1 of `--k` samples at the training temperature, response tokens, and for the
calculator per sampled episode the share that called the tool, tool calls, failed calls and
turns. Each model with an
engine of its own, but the RL stage's two versions share one.

Resumable. A finished cell writes `benchmarks/recipes/<cell>.json` (a study other than the
calculator: `benchmarks/recipes/<study>/<cell>.json`) and is not run again; an interrupted one
resumes its recipe (finished stages are skipped, the running one resumes from its checkpoint;
its wall-clock is then marked not comparable). The report — the study's tables between its
markers in `benchmarks/RESULTS.md` — is rewritten after every cell. A finished cell's weights,
checkpoints and exported models are deleted; metrics and logs stay in `--workdir`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.learning_study import run_child
from benchmarks.recipe_studies import STUDIES, Point, Study

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"


def cells_dir(study: Study) -> Path:
    """Where a study's finished cells are kept (the calculator's where it always was)."""
    cells = ROOT / "benchmarks" / "recipes"
    return cells if study.name == "calculator" else cells / study.name


def cell_name(arm: str, seed: int) -> str:
    return f"{arm}-s{seed}"


def recipe_file(study: Study, arm: str, workdir: Path) -> Path:
    """The arm's recipe (`Study.recipe_for` of the bundled one), written into `workdir`."""
    from streamrl.recipes import load_recipe

    _, bundled = load_recipe(study.recipe)
    recipe = study.recipe_for(arm, bundled.model_dump(mode="json"))
    path = workdir / f"{study.recipe}-{arm}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def rl_stage(recipe: dict[str, Any]) -> str:
    """The recipe's last training stage: the RL stage the models are evaluated under."""
    return recipe["stages"][-1]["name"]


def seed_overrides(seed: int) -> list[str]:
    return [f"learner.seed={seed}", f"generator.seed={seed}", f"data.shuffle_seed={seed}"]


def train(study: Study, arm: str, seed: int, root: Path) -> dict[str, Any]:
    """Run (or resume) the cell's recipe; when it first started and whether it resumed."""
    started_file = root.parent / f"{root.name}.started.json"
    resumed = started_file.exists()
    if not resumed:
        started_file.write_text(json.dumps({"time": time.time()}))
    started = json.loads(started_file.read_text())["time"]
    argv = [sys.executable, "-m", "flows.demo", "--recipe",
            str(recipe_file(study, arm, root.parent)), "--run-uri", str(root),
            *(["--resume"] if resumed else []), *seed_overrides(seed)]  # fmt: skip
    print(f"  $ {' '.join(argv[1:])}", flush=True)
    with (root.parent / f"{root.name}.out").open("a") as out:
        code = run_child(argv, out)
    if code != 0:
        raise SystemExit(f"{cell_name(arm, seed)}: the recipe exited {code}; see "
                         f"{root.parent / f'{root.name}.out'} and {root}/*/logs/")  # fmt: skip
    return {"started": started, "resumed": resumed, "finished": time.time()}


def engines(points: tuple[Point, ...]) -> list[list[Point]]:
    """The points grouped by the engine that measures them: the RL stage's versions share one
    (version 0 first: a fresh engine serves it), any other model has its own."""
    rl = [p for p in points if p.source.startswith("rl:")]
    return [[p] for p in points if not p.source.startswith("rl:")] + ([rl] if rl else [])


def evaluate(
    args: argparse.Namespace, study: Study, arm: str, seed: int, root: Path
) -> dict[str, Any]:
    """The arm's models, each group of points in a fresh evaluator process. The base model is
    measured once per seed: every arm's is the same model under the same settings."""
    results: dict[str, dict[str, Any]] = {}
    for group in engines(study.points(arm)):
        names = [p.name for p in group]
        shared = [p.source for p in group] == ["base"]
        out = root.parent / (f"base-s{seed}.eval-base.json" if shared
                             else f"{root.name}.eval-{'-'.join(names)}.json")  # fmt: skip
        if not out.exists():
            argv = [sys.executable, "-m", "benchmarks.recipe_study", "--study", study.name,
                    "--evaluate", str(root), "--arms", arm, "--points", ",".join(names),
                    "--k", str(args.k), "--eval-prompts", str(args.eval_prompts),
                    "--out", str(out)]  # fmt: skip
            log = root.parent / f"{root.name}.eval.out"
            with log.open("a") as stream:
                if run_child(argv, stream) != 0:
                    raise SystemExit(f"evaluating {root} failed; see {log}")
        results.update(json.loads(out.read_text()))
    return results


def evaluator_main(args: argparse.Namespace, study: Study) -> None:
    """`--evaluate ROOT --arms ARM --points P,...`: the evaluator process of one engine."""
    from storage.fs import open_location
    from storage.weights.versions import WeightStore
    from streamrl.config.stored import load_run_config
    from streamrl.data.config import DataConfig
    from streamrl.evaluation.evaluator import Evaluator

    root = Path(args.evaluate)
    recipe = yaml.safe_load(recipe_file(study, args.arms, root.parent).read_text())
    rl = open_location(str(root / rl_stage(recipe)))
    wanted = set(args.points.split(","))
    points = [p for p in study.points(args.arms) if p.name in wanted]
    config = load_run_config(rl)
    model = _model_of(points[0].source, root, recipe)
    if model is not None:  # a model of its own at version 0, under the RL stage's settings
        config = config.model_copy(update={"model": config.model.model_copy(
            update={"path": model})})  # fmt: skip
    last = WeightStore(rl).latest_version()
    assert last is not None, "the RL stage published no version"
    dataset = config.data.model_copy(update={"path": study.eval_dataset, "val_path": None})
    assert isinstance(dataset, DataConfig)
    results = {}
    with Evaluator(rl, config, dataset=dataset, k=args.k, max_prompts=args.eval_prompts) as ev:
        assert ev.held_out
        for point in points:
            started = time.perf_counter()
            metrics = ev.evaluate(last if point.source == "rl:last" else 0)
            assert metrics is not None
            results[point.name] = {**ev.record(metrics), "eval_s": time.perf_counter() - started}
            print(point.name, json.dumps(results[point.name]), flush=True)
    Path(args.out).write_text(json.dumps(results))


def _model_of(source: str, root: Path, recipe: dict[str, Any]) -> str | None:
    """The model directory a point's engine starts from; None: the RL stage's own."""
    from storage.fs import open_location
    from streamrl.config.stored import load_run_config

    if source == "base":
        first = recipe["stages"][0]["name"]
        return load_run_config(open_location(str(root / first))).model.path
    if source.startswith("stage:"):
        return str(root / "models" / source.removeprefix("stage:"))
    return None


def stage_summary(study: Study, root: Path, stage: str) -> dict[str, Any]:
    """The stage's learner steps, each record the study's keys only."""
    from storage.fs import open_location
    from streamrl.learner.metrics_records import read_metrics

    records = read_metrics(open_location(str(root / stage)))
    return {"steps": [{k: r[k] for k in study.stage_keys if k in r} for r in records]}


def run_cell(args: argparse.Namespace, study: Study, arm: str, seed: int) -> None:
    name = cell_name(arm, seed)
    result_file = cells_dir(study) / f"{name}.json"
    if result_file.exists():
        print(f"{name}: done before ({result_file})")
        return
    root = Path(args.workdir).resolve() / study.name / name
    root.parent.mkdir(parents=True, exist_ok=True)
    result_file.parent.mkdir(parents=True, exist_ok=True)
    timing_file = root.parent / f"{name}.timing.json"
    if not timing_file.exists():
        print(f"{name}: the recipe in {root}", flush=True)
        timing_file.write_text(json.dumps(train(study, arm, seed, root)))
    timing = json.loads(timing_file.read_text())
    print(f"{name}: evaluating {', '.join(p.label for p in study.points(arm))}", flush=True)
    evaluations = evaluate(args, study, arm, seed, root)
    recipe = yaml.safe_load(recipe_file(study, arm, root.parent).read_text())
    stages = [stage["name"] for stage in recipe["stages"]]
    record = {
        "study": study.name,
        "arm": arm,
        "seed": seed,
        "recipe": recipe,
        "seed_overrides": seed_overrides(seed),
        "wall_s": timing["finished"] - timing["started"],
        "wall_comparable": not timing["resumed"],
        "evaluations": evaluations,
        "stages": {stage: stage_summary(study, root, stage) for stage in stages},
        "eval_prompts": args.eval_prompts,
        "k": args.k,
    }
    result_file.write_text(json.dumps(record, indent=1) + "\n")
    for stage in stages:  # the evaluations are made: weights and checkpoints go
        for part in ("weights", "checkpoints"):
            shutil.rmtree(root / stage / part, ignore_errors=True)
    shutil.rmtree(root / "models", ignore_errors=True)
    print(f"{name}: done ({record['wall_s']:.0f} s)", flush=True)


def write_report(study: Study) -> None:
    cells = [json.loads(p.read_text()) for p in sorted(cells_dir(study).glob("*.json"))]
    text = RESULTS.read_text()
    begin, end = study.markers
    if begin not in text:
        raise SystemExit(f"{RESULTS} has no {begin} … {end} markers for the table")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    table = "\n".join(study.report(cells))
    RESULTS.write_text(f"{head}{begin}\n{table}\n{end}{tail}")
    print(f"report: {len(cells)} cells → {RESULTS}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--study", default="calculator", choices=sorted(STUDIES))
    parser.add_argument("--arms", help="the study's arms, comma-separated (default: all)")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--eval-prompts", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="samples per problem for pass@1")
    parser.add_argument("--workdir", default=str(ROOT / "runs" / "recipe-study"))
    parser.add_argument("--report", action="store_true", help="rewrite the tables only")
    parser.add_argument("--evaluate", metavar="ROOT", help=argparse.SUPPRESS)
    parser.add_argument("--points", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    study = STUDIES[args.study]
    if args.evaluate:
        evaluator_main(args, study)
        return
    if not args.report:
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        arms = args.arms.split(",") if args.arms else list(study.arms)
        if unknown := sorted(set(arms) - set(study.arms)):
            parser.error(f"unknown arms {unknown}; choose from {', '.join(study.arms)}")
        for seed in (int(s) for s in args.seeds.split(",")):
            for arm in arms:
                run_cell(args, study, arm, seed)
                write_report(study)
        return
    write_report(study)


if __name__ == "__main__":
    main()
