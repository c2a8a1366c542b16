"""The whole loop on one CPU box: seconds per learner step with the generator and the learner
running together, against each of them alone, for two core splits; and asynchronous against
synchronous training.

    .venv/bin/python -m benchmarks.loop_bench  # --size smollm2-cpu --steps 3 --parts together,sync
    .venv/bin/python -m benchmarks.loop_bench --size tiny-cpu --steps 3      # smoke run, ~3 min

Seven runs: together, learner alone and generator alone for each of two core splits, and the
synchronous run. With smollm2-cpu and 3 steps, about 20 minutes on a quiet 2-core box (one
3-step `streamrl run` took 8.5 minutes at load average 5–6). Each run's folder is kept with
`--workdir DIR` (logs in `<run>/logs/`, `<run>.out` for `streamrl run`).

Every run is DAPO with the size preset (`--preset dapo --preset <size>`), one generator,
`learner.total_steps=--steps`, no evaluator, no wandb and no checkpoint but the learner's last.
A learner step is `perf/step_s + perf/weight_sync_s` of its metrics record (`read_metrics`):
collecting the batch (waiting for the generator included), training and publishing the weights;
the final checkpoint is left out. The first step (vLLM and model start-up) is not averaged.

*together* — generator and learner at once, per core split:
  - `plan`: a real `streamrl run --generators 1` with the placement plan's default split
    (on 2 cores the learner on core 0, the generator on core 1);
  - `shared`: both on every core. The plan refuses overlapping `learner.cpu_cores` /
    `generator.cpu_cores` (and only lets components share when fewer free cores than
    components remain), so this variant bypasses it: the benchmark creates the run and starts
    `streamrl learner` and `streamrl generator --index 0` itself, each as `streamrl run` would
    start a planned process (CPU affinity + `ProcessPlacement.env()`: OpenMP/MKL threads = all
    cores, vLLM threads bound to them, sleeping OpenMP waits), with `shared` placements on all
    cores.
*learner alone* — `streamrl learner` on the split's learner cores, on a copy of the together
run's replay stream (same configuration): it consumes the same groups in the same order at
the same policy versions, so it makes the same staleness and dynamic-sampling decisions, and
never waits for a group.
*generator alone* — `streamrl generator --index 0` on the split's generator cores in a fresh run
with `generator.flow_control=off` (no learner consumes, so flow control would pause it), stopped
once it has committed as many groups as the together learner consumed in its measured steps
(and at least 4 segments after its first). Its rate is the groups committed after its first
segment over the time between the first and the last commit (`committed_at` of the commit
records); its time per step is the together run's mean `stream/consumed` per step (accepted +
rejected) over that rate.

The ratios: together / (learner alone + generator alone) — the goal is ≤ 1.2 — and together /
max(learner alone, generator alone), which perfect pipelining would bring to 1.0.

*sync* — the `plan` split with `learner.max_staleness=0` (generation waits for each new
version: flow control `staleness`, the default) against DAPO's `learner.max_staleness=4` (the
together/plan run, reused when both parts run).

Few steps are a steady state when the learner is the slower side (it never waits; the
generator idles under flow control). When the generator is slower, the learner first trains on
the backlog flow control lets build up during the first step ((max_staleness + 1) × B / accept
rate groups): the report says so when together comes out faster than the generator alone.

`--size tiny-cpu` is a smoke run: the random-init model is almost never right, so DAPO's
dynamic sampling would reject ~99.7% of its groups (minutes of generation per step); it runs
with `algorithm.dynamic_sampling=false`.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from storage.control.manifest import create_run
from storage.fs import open_location
from storage.stream.log import read_log
from streamrl.config.base import format_cores
from streamrl.config.loading import load_config
from streamrl.learner.metrics_records import read_metrics
from streamrl.placement import (
    PLACED_VARIABLES,
    ProcessPlacement,
    machine_cpus,
    read_placement,
)

ROOT = Path(__file__).resolve().parents[1]
STREAMRL = [sys.executable, "-m", "streamrl"]
SIZE_OVERRIDES = {"smollm2-cpu": [], "tiny-cpu": ["algorithm.dynamic_sampling=false"]}
MIN_SEGMENTS = 4  # the generator alone commits at least this many after its first


# -- runs ------------------------------------------------------------------------------------


def overrides(args: argparse.Namespace, run_dir: Path, *extra: str) -> list[str]:
    """The dotted overrides of every run of the benchmark, then `extra`."""
    return [
        f"storage.run_uri={run_dir}",
        f"learner.total_steps={args.steps}",
        f"learner.checkpoint_every={args.steps + 1}",  # only the one at the last step
        "eval.every_versions=0",
        "logging.wandb_mode=disabled",
        *SIZE_OVERRIDES[args.size],
        *args.override,
        *extra,
    ]


def new_run(args: argparse.Namespace, run_dir: Path, *extra: str) -> None:
    """Create a run (its run.json), as `streamrl run` does before it starts anything."""
    config = load_config(["dapo", args.size], overrides=overrides(args, run_dir, *extra))
    create_run(open_location(str(run_dir)), config.model_dump(mode="json"))


def streamrl_run(args: argparse.Namespace, run_dir: Path, *extra: str) -> None:
    """A whole run under `streamrl run` (its placement plan, its supervisor)."""
    argv = [*STREAMRL, "run", "--preset", "dapo", "--preset", args.size, "--generators", "1"]
    argv += overrides(args, run_dir, *extra)
    print(f"  $ {shlex.join(['streamrl', *argv[3:]])}", flush=True)
    log = run_dir.parent / f"{run_dir.name}.out"
    with log.open("w") as out:
        process = subprocess.Popen(
            argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    wait_ok(process, log, "streamrl run", args.timeout_s)  # SIGTERM stops the whole run


def start_placed(argv: list[str], placement: ProcessPlacement, log: Path) -> subprocess.Popen:
    """`argv` started as `streamrl run` starts a planned process: on the placement's cores
    (affinity, inherited by its threads and children) with its environment."""
    env = {k: v for k, v in os.environ.items() if k not in PLACED_VARIABLES}
    env |= {"PYTHONUNBUFFERED": "1", **placement.env()}
    cpus = placement.cpus
    with log.open("w") as out:
        return subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: vLLM's and the reward workers too
            preexec_fn=lambda: os.sched_setaffinity(0, cpus),
        )


def stop(process: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGTERM to the process's group (a generator flushes and exits 0), SIGKILL after
    `grace_s`."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def wait_ok(process: subprocess.Popen, log: Path, what: str, timeout_s: float) -> None:
    """Wait for `process` to exit 0; stop it on a timeout or an interrupt (Ctrl-C does not
    reach its process group)."""
    try:
        code = process.wait(timeout_s)
    except subprocess.TimeoutExpired as exc:
        stop(process, grace_s=30)
        raise RuntimeError(
            f"{what} ran over {timeout_s:.0f}s; last lines of {log}:\n{_tail(log)}"
        ) from exc
    except BaseException:
        stop(process, grace_s=30)
        raise
    if code != 0:
        raise RuntimeError(f"{what} exited with {code}; last lines of {log}:\n{_tail(log)}")


def learner_command(run_dir: Path) -> list[str]:
    return [*STREAMRL, "learner", "--run", str(run_dir)]


def generator_command(run_dir: Path) -> list[str]:
    return [*STREAMRL, "generator", "--run", str(run_dir), "--index", "0"]


def placed_run(
    args: argparse.Namespace, run_dir: Path, learner: ProcessPlacement, gen: ProcessPlacement
) -> None:
    """Learner and generator together on the given placements, the plan bypassed."""
    new_run(args, run_dir)
    logs = run_dir / "logs"
    logs.mkdir()
    generator = start_placed(generator_command(run_dir), gen, logs / "gen0.log")
    try:
        trainer = start_placed(learner_command(run_dir), learner, logs / "learner.log")
        wait_ok(trainer, logs / "learner.log", "the learner", args.timeout_s)
        with contextlib.suppress(subprocess.TimeoutExpired):
            generator.wait(60)  # it stops at the learner's stop marker
    finally:
        stop(generator)


def learner_alone(
    args: argparse.Namespace, run_dir: Path, source: Path, placement: ProcessPlacement
) -> None:
    """The learner on a copy of `source`'s replay stream, nothing generating."""
    new_run(args, run_dir)
    shutil.copytree(source / "stream", run_dir / "stream")
    log = run_dir / "learner.log"
    wait_ok(
        start_placed(learner_command(run_dir), placement, log), log, "the learner", args.timeout_s
    )


def generator_alone(
    args: argparse.Namespace, run_dir: Path, placement: ProcessPlacement, groups: int
) -> None:
    """The generator, flow control off, until `groups` more groups than its first segment's
    are committed."""
    new_run(args, run_dir, "generator.flow_control=off")
    log = run_dir / "gen0.log"
    process = start_placed(generator_command(run_dir), placement, log)
    deadline = time.monotonic() + args.timeout_s
    try:
        while True:
            records = list(read_log(open_location(str(run_dir))))
            after_first = sum(r.num_groups for r in records[1:])
            if len(records) > MIN_SEGMENTS and after_first >= groups:
                return
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the generator alone stopped or ran over:\n{_tail(log)}")
            time.sleep(1.0)
    finally:
        stop(process)


def _tail(path: Path, lines: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# -- figures ---------------------------------------------------------------------------------


def learner_figures(run_dir: Path) -> dict[str, Any]:
    """Means over the measured steps (all but the first) of the run's learner records."""
    records = [
        r for r in read_metrics(open_location(str(run_dir))) if "value_pretrain_step" not in r
    ]
    measured = records[1:]
    if not measured:
        raise RuntimeError(f"{run_dir} logged {len(records)} step(s); run at least 2 (--steps)")

    def mean(key: str) -> float:
        return statistics.mean(float(r.get(key, 0.0)) for r in measured)

    each = [r["perf/step_s"] + r.get("perf/weight_sync_s", 0.0) for r in records]
    return {
        "s_step": statistics.mean(each[1:]),
        "steps_s": each,  # every step's seconds, the first included
        "step_s": mean("perf/step_s"),
        "wait_s": mean("perf/wait_s"),
        "sync_s": mean("perf/weight_sync_s"),
        "tokens_s": mean("perf/learner_tokens_per_s"),
        "consumed": mean("stream/consumed"),
        "response_len": mean("rollout/response_len_mean"),
        "accepted": mean("stream/accepted"),
        "stale": mean("stream/dropped_stale"),
        "consumed_list": [int(r["stream/consumed"]) for r in measured],
        "window": (records[0]["time"], records[-1]["time"]),
        **cpu_figures(records),
    }


def cpu_figures(records: list[dict[str, Any]]) -> dict[str, float]:
    """How busy the machine's cores were from the first step's record to the last, from the
    components' own metrics: the learner's CPU seconds in each later step
    (`perf/learner_cpu_s`) and the generators' (`generators/cpu_s_total`, as of their last
    commits), over the window's wall time × this machine's cores. Empty for records without
    them (a run before these metrics)."""
    last, first = records[-1], records[0]
    if "perf/learner_cpu_s" not in last or "generators/cpu_s_total" not in last:
        return {}
    capacity = (last["time"] - first["time"]) * len(machine_cpus())
    learner = sum(float(r["perf/learner_cpu_s"]) for r in records[1:])
    generators = float(last["generators/cpu_s_total"]) - float(first["generators/cpu_s_total"])
    return {
        "cpu_busy": (learner + generators) / capacity,
        "cpu_learner": learner / capacity,
        "cpu_generators": generators / capacity,
    }


def generator_figures(run_dir: Path, window: tuple[float, float] | None = None) -> dict[str, float]:
    """Groups/s and response tokens per group from the commit log: the groups committed after
    the first commit (inside `window`, wall-clock times, when given) over the time from it to
    the last."""
    records = list(read_log(open_location(str(run_dir))))
    if window is not None:
        records = [r for r in records if window[0] <= r.committed_at <= window[1]]
    if len(records) < 2:
        return {"groups_s": math.nan, "tokens_group": math.nan}
    after = records[1:]
    groups = sum(r.num_groups for r in after)
    return {
        "groups_s": groups / (records[-1].committed_at - records[0].committed_at),
        "tokens_group": sum(r.num_tokens for r in after) / groups,
    }


# -- the parts -------------------------------------------------------------------------------


def split_placements(split: str, together: Path) -> tuple[ProcessPlacement, ProcessPlacement]:
    """The learner's and the generator's placements of a split: the plan's as `streamrl run`
    stored it, or both on every core."""
    if split == "plan":
        plan = read_placement(open_location(str(together)))
        return plan.learner, plan.generators[0]
    cpus, threads = tuple(machine_cpus()), len(machine_cpus())
    return (
        ProcessPlacement(
            name="learner", component="learner", cpus=cpus, threads=threads, shared=True
        ),
        ProcessPlacement(
            name="gen0", component="generator", cpus=cpus, threads=threads, shared=True
        ),
    )


def timed(label: str, fn, *fn_args) -> None:
    print(f"{label} ...", flush=True)
    started = time.monotonic()
    fn(*fn_args)
    print(f"  done in {time.monotonic() - started:.0f}s", flush=True)


def together_part(args: argparse.Namespace, work: Path, split: str) -> dict[str, Any]:
    together = work / f"together-{split}"
    if split == "plan":
        if not together.exists():  # the sync part may have run it
            timed("together, plan split (streamrl run)", streamrl_run, args, together)
    else:
        learner, gen = split_placements(split, together)
        timed(f"together, {split} split (plan bypassed)", placed_run, args, together, learner, gen)
    learner, gen = split_placements(split, together)
    row = {"split": split, "learner_cores": learner.cpus, "generator_cores": gen.cpus}
    row["together"] = learner_figures(together)
    row["together_gen"] = generator_figures(together, row["together"]["window"])
    timed(
        f"learner alone, {split} split",
        learner_alone,
        args,
        work / f"learner-{split}",
        together,
        learner,
    )
    row["learner"] = learner_figures(work / f"learner-{split}")
    if row["learner"]["consumed_list"] != row["together"]["consumed_list"]:
        print(f"  note: the learner alone consumed {row['learner']['consumed_list']} groups per "
              f"step, together {row['together']['consumed_list']}")  # fmt: skip
    groups = max(sum(row["together"]["consumed_list"]), 1)
    timed(
        f"generator alone, {split} split",
        generator_alone,
        args,
        work / f"generator-{split}",
        gen,
        groups,
    )
    row["generator"] = generator_figures(work / f"generator-{split}")
    return row


def sync_part(args: argparse.Namespace, work: Path) -> dict[int, dict[str, Any]]:
    runs = {4: work / "together-plan", 0: work / "sync-staleness0"}
    if not runs[4].exists():
        timed("async: max_staleness=4, plan split (streamrl run)", streamrl_run, args, runs[4])
    timed(
        "sync: max_staleness=0, plan split (streamrl run)",
        streamrl_run,
        args,
        runs[0],
        "learner.max_staleness=0",
    )
    figures = {staleness: learner_figures(run) for staleness, run in runs.items()}
    for staleness, fig in figures.items():
        fig["gen"] = generator_figures(runs[staleness], fig["window"])
    return figures


# -- report ----------------------------------------------------------------------------------


def report_together(rows: list[dict[str, Any]]) -> None:
    print("\n## Together vs alone (seconds per learner step)")
    print("| split | learner cores | generator cores | together | learner alone | "
          "generator alone | sum of alone | together / sum (goal ≤ 1.2) | "
          "together / max (ideal 1.0) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        t, lrn = row["together"]["s_step"], row["learner"]["s_step"]
        gen = row["together"]["consumed"] / row["generator"]["groups_s"]
        row["gen_s_step"] = gen
        print(
            f"| {row['split']} | {format_cores(row['learner_cores'])} | "
            f"{format_cores(row['generator_cores'])} | {t:.3g} | {lrn:.3g} | {gen:.3g} | "
            f"{lrn + gen:.3g} | {t / (lrn + gen):.3f} | {t / max(lrn, gen):.3f} |"
        )
    print("\n| run | steps measured | s/step | train+wait (step_s) | wait_s | publish_s | "
          "learner tokens/s | consumed/step | accepted/step | stale/step | generator groups/s | "
          "response tokens/group |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        for name, fig, gen in (
            ("together", row["together"], row["together_gen"]),
            ("learner alone", row["learner"], None),
        ):
            gen_cells = " | ".join(
                _fmt(gen[k]) if gen else "–" for k in ("groups_s", "tokens_group")
            )
            print(
                f"| {name}, {row['split']} | {len(fig['consumed_list'])} | {fig['s_step']:.3g} | "
                f"{fig['step_s']:.3g} | {fig['wait_s']:.3g} | {fig['sync_s']:.3g} | "
                f"{fig['tokens_s']:.4g} | {fig['consumed']:.3g} | {fig['accepted']:.3g} | "
                f"{fig['stale']:.3g} | {gen_cells} |"
            )
        gen = row["generator"]
        print(
            f"| generator alone, {row['split']} | – | {row['gen_s_step']:.3g} | – | – | – | – | "
            f"{row['together']['consumed']:.3g} | – | – | {gen['groups_s']:.3g} | "
            f"{gen['tokens_group']:.3g} |"
        )
    for row in rows:
        if row["together"]["s_step"] < 0.9 * row["gen_s_step"]:
            print(
                f"\nnote ({row['split']}): together beat the generator alone, so the learner "
                "trained on groups generated before its measured steps (flow control lets up to "
                "(max_staleness + 1) × batch_groups / accept rate groups wait); with a generator "
                "slower than the learner only more --steps give the steady state"
            )
    if len(rows) > 1:
        best = min(rows, key=lambda r: r["together"]["s_step"])
        others = ", ".join(
            f"{r['split']} {r['together']['s_step']:.3g} s" for r in rows if r is not best
        )
        print(
            f"\nfastest together: {best['split']} split, {best['together']['s_step']:.3g} s/step "
            f"(against {others})"
        )


def _fmt(value: float) -> str:
    """A figure, or '–' for one a run could not give (fewer than 2 commits in its window)."""
    return "–" if math.isnan(value) else f"{value:.3g}"


def report_sync(runs: dict[int, dict[str, Any]]) -> None:
    print("\n## Async vs sync (plan split, seconds per learner step)")
    print("| learner.max_staleness | s/step | wait_s | publish_s | consumed/step | accepted/step | "
          "stale/step | learner tokens/s | generator groups/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for staleness in (0, 4):
        fig = runs[staleness]
        print(
            f"| {staleness} | {fig['s_step']:.3g} | {fig['wait_s']:.3g} | {fig['sync_s']:.3g} | "
            f"{fig['consumed']:.3g} | {fig['accepted']:.3g} | {fig['stale']:.3g} | "
            f"{fig['tokens_s']:.4g} | {_fmt(fig['gen']['groups_s'])} |"
        )
    ratio = runs[0]["s_step"] / runs[4]["s_step"]
    print(f"\nsync / async s/step: {ratio:.3f} (async is {ratio:.2f}× as fast)")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", choices=sorted(SIZE_OVERRIDES), default="smollm2-cpu")
    parser.add_argument(
        "--steps", type=int, default=3, help="learner steps per run (the first is warm-up)"
    )
    parser.add_argument("--parts", default="together,sync", help="comma-separated: together, sync")
    parser.add_argument("--splits", default="plan,shared", help="core splits of the together part")
    parser.add_argument(
        "--override", action="append", default=[], metavar="KEY=VALUE", help="applied to every run"
    )
    parser.add_argument("--timeout-s", type=float, default=1800, help="limit per process")
    parser.add_argument("--workdir", help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if not parts <= {"together", "sync"} or args.steps < 2:
        parser.error("--parts takes together and/or sync; --steps must be ≥ 2")

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp).resolve()
        work.mkdir(parents=True, exist_ok=True)
        print(f"DAPO + {args.size}, 1 generator, {args.steps} learner steps per run (first "
              f"not measured), cores {format_cores(machine_cpus())}; runs in {work}",
              flush=True)  # fmt: skip
        started = time.monotonic()
        rows = (
            [together_part(args, work, s) for s in args.splits.split(",")]
            if "together" in parts
            else []
        )
        runs = sync_part(args, work) if "sync" in parts else None
        if rows:
            report_together(rows)
        if runs:
            report_sync(runs)
        print(f"\nbenchmark wall time: {(time.monotonic() - started) / 60:.1f} min")


if __name__ == "__main__":
    main()
