"""The learning study's report (`benchmarks.learning_study`): tables, goals and a figure from
the finished cells in `benchmarks/learning/`.

    .venv/bin/python -m benchmarks.learning_study --report

A cell file (`<arm>-s<seed>.json`) holds its evaluations (`version` = step, `val/acc_greedy`,
`val/avg@k` = sampled pass@1, `val/response_len_mean`), its learner records per step (`time`,
`stream/*`) and `wall_s`, launch to the final step's record. `base-s<seed>.json` holds step 0,
the base model, for that seed. Spreads are sample standard deviations over seeds (n − 1);
"±" is left out with one seed. The table sits in `benchmarks/LEARNING.md` between
`BEGIN_MARK` and `END_MARK` (rewritten whole); the figure is `benchmarks/learning.png`.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LEARNING_MD = HERE / "LEARNING.md"
FIGURE = HERE / "learning.png"
BEGIN_MARK = "<!-- study results: written by benchmarks/learning_report.py -->"
END_MARK = "<!-- end of study results -->"
ARM_ORDER = ("grpo", "dr_grpo", "dapo", "vapo", "dapo_sync", "gspo", "cispo", "sapo", "opd")
ARM_LABELS = {
    "grpo": "GRPO",
    "dr_grpo": "Dr. GRPO",
    "dapo": "DAPO",
    "vapo": "VAPO",
    "dapo_sync": "DAPO sync",
    "gspo": "GSPO",
    "cispo": "CISPO",
    "sapo": "SAPO",
    "opd": "OPD",
}
GREEDY, LENGTH = "val/acc_greedy", "val/response_len_mean"
DEFAULT_SEEDS, LATER_SEEDS = 3, 2
SEEDS_WANTED = dict.fromkeys(("gspo", "cispo", "sapo", "opd"), LATER_SEEDS)
"""Seeds an arm's verdicts wait for: three for the first study's arms (#29), two for the
policy-loss arms (#45) and on-policy distillation (#46), as their issues ask; others three."""


def greedy(evaluation: dict[str, Any]) -> float:
    return float(evaluation[GREEDY])


def pass_at_1(evaluation: dict[str, Any]) -> float:
    return float(evaluation[f"val/avg@{evaluation['k']}"])


METRICS: tuple[tuple[str, Callable[[dict], float]], ...] = (
    ("greedy", greedy),
    ("pass@1", pass_at_1),
)


TEACHER_RECORD = "teacher.json"


def load_cells(cells_dir: Path) -> tuple[dict[str, list[dict]], dict[int, dict]]:
    """(arm → its finished cells by seed, seed → the base model's evaluation); the teacher's
    record (`teacher.json`, the opd arm's teacher) is not a cell."""
    arms: dict[str, list[dict]] = {}
    bases: dict[int, dict] = {}
    for path in sorted(cells_dir.glob("*.json")):
        if path.name == TEACHER_RECORD:
            continue
        cell = json.loads(path.read_text())
        if path.name.startswith("base-"):
            bases[cell["seed"]] = cell["evaluations"][0]
        else:
            arms.setdefault(cell["arm"], []).append(cell)
    for cells in arms.values():
        cells.sort(key=lambda c: c["seed"])
    return arms, bases


def spread(values: Sequence[float]) -> tuple[float, float]:
    """(mean, sample standard deviation; 0 for one value)."""
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) if len(values) > 1 else 0.0)


def fmt(values: Sequence[float], digits: int = 3) -> str:
    if not values:
        return "—"
    mean, std = spread(values)
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if len(values) > 1 else "")


class Arm:
    """One arm's finished cells, with the base evaluations of their seeds as step 0."""

    def __init__(self, name: str, cells: list[dict], bases: dict[int, dict]) -> None:
        self.name, self.label, self.cells = name, ARM_LABELS.get(name, name), cells
        self.seeds = [c["seed"] for c in cells]
        self.by_step: dict[int, list[dict]] = {}
        for cell in cells:
            evaluations = list(cell["evaluations"])
            if cell["seed"] in bases:
                evaluations.append({**bases[cell["seed"]], "version": 0})
            for evaluation in evaluations:
                self.by_step.setdefault(int(evaluation["version"]), []).append(
                    {**evaluation, "elapsed_s": elapsed_s(cell, int(evaluation["version"]))}
                )

    @property
    def steps(self) -> list[int]:
        return sorted(self.by_step)

    def values(self, step: int, metric: Callable[[dict], float]) -> list[float]:
        return [metric(e) for e in self.by_step.get(step, [])]

    def run_means(self, key: str, last: int | None = None) -> list[float]:
        """Each cell's mean over its steps (its `last` steps) of learner metric `key`, for the
        cells that recorded it (the first step left out: it includes starting vLLM and the
        model)."""
        means = []
        for cell in self.cells:
            values = [s[key] for s in cell["steps"][1:] if key in s]
            if values:
                means.append(statistics.fmean(values[-last:] if last else values))
        return means


def elapsed_s(cell: dict, step: int) -> float:
    """Seconds from the cell's launch to its learner record of `step` (0 at step 0)."""
    if step == 0:
        return 0.0
    records = {s["step"]: s for s in cell["steps"]}
    started = cell["steps"][-1]["time"] - cell["wall_s"]
    return records[step]["time"] - started


def tables(arms: list[Arm]) -> list[str]:
    steps = sorted({s for arm in arms for s in arm.steps})
    lines = []
    for title, metric in (
        ("Held-out greedy accuracy", greedy),
        ("Held-out sampled pass@1", pass_at_1),
        ("Mean sampled response length (tokens)", lambda e: float(e[LENGTH])),
    ):
        lines += [f"**{title}** (mean ± std over seeds; step 0 is the base model)", ""]
        lines += ["| arm | seeds | " + " | ".join(f"step {s}" for s in steps) + " |"]
        lines += ["|---|---|" + "---|" * len(steps)]
        digits = 1 if "length" in title else 3
        for arm in arms:
            cells = [fmt(arm.values(s, metric), digits) for s in steps]
            lines.append(f"| {arm.label} | {len(arm.seeds)} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["**Runs** (means over seeds of per-run means; the first step, which starts vLLM "
              "and the model, is left out of the per-step figures; staleness: versions between "
              "a trained group's sampling policy and the learner's; entropy: the policy's mean "
              "token entropy on its batch)", ""]  # fmt: skip
    lines += ["| arm | seeds | wall-clock to the last step (s) | s/step | consumed/step | "
              "stale/step | zero-variance/step | staleness | entropy, last 8 steps | resumed |",
              "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for arm in arms:
        walls = [c["wall_s"] for c in arm.cells]
        per_step = [
            (c["steps"][-1]["time"] - c["steps"][0]["time"]) / max(len(c["steps"]) - 1, 1)
            for c in arm.cells
        ]
        resumed = sum(bool(c["resumed"]) for c in arm.cells)
        lines.append(
            f"| {arm.label} | {len(arm.seeds)} | {fmt(walls, 0)} | {fmt(per_step, 1)} | "
            f"{fmt(arm.run_means('stream/consumed'), 1)} | "
            f"{fmt(arm.run_means('stream/dropped_stale'), 2)} | "
            f"{fmt(arm.run_means('stream/dropped_zero_var'), 2)} | "
            f"{recorded(arm, arm.run_means('stream/staleness_mean'))} | "
            f"{recorded(arm, arm.run_means('actor/entropy', last=8))} | {resumed} |"
        )
    return [*lines, "", *critic_table(arms)]


def recorded(arm: Arm, values: list[float]) -> str:
    """`values` over the cells that recorded them, saying how many when not every cell did
    (cells measured before the study kept a metric lack it)."""
    some = f" ({len(values)} of {len(arm.cells)})" if 0 < len(values) < len(arm.cells) else ""
    return fmt(values, 2) + some


def critic_table(arms: list[Arm]) -> list[str]:
    """The value model's pre-training and its explained variance (arms with a critic only)."""
    critics = [arm for arm in arms if any(c.get("value_pretrain") for c in arm.cells)]
    if not critics:
        return []
    lines = ["**Value model** (critic-only pre-training steps before step 1, and the critic's "
             "explained variance of its targets on each batch before its update)", "",
             "| arm | seeds | pre-training steps | pre-training (s) | explained variance: "
             "first 5 pre-training steps | last 5 pre-training steps | last 8 steps |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    ev = "critic/explained_var"
    for arm in critics:
        cells = [c for c in arm.cells if c.get("value_pretrain")]
        pre = [c["value_pretrain"] for c in cells]
        launched = [c["steps"][-1]["time"] - c["wall_s"] for c in cells]
        seconds = [p[-1]["time"] - t for p, t in zip(pre, launched, strict=True)]
        first = [statistics.fmean(r[ev] for r in p[:5]) for p in pre]
        last = [statistics.fmean(r[ev] for r in p[-5:]) for p in pre]
        trained = [statistics.fmean(s[ev] for s in c["steps"][-8:] if ev in s) for c in cells]
        lines.append(
            f"| {arm.label} | {len(cells)} | {fmt([len(p) for p in pre], 0)} | "
            f"{fmt(seconds, 0)} | {fmt(first)} | {fmt(last)} | {fmt(trained)} |"
        )
    return [*lines, ""]


def compare(first: Sequence[float], second: Sequence[float]) -> tuple[float, float]:
    """(mean of `first` − mean of `second`, the larger of their two seed spreads)."""
    return spread(first)[0] - spread(second)[0], max(spread(first)[1], spread(second)[1])


def goals(arms: dict[str, Arm], bases: dict[int, dict]) -> list[str]:
    """The issues' goals, each met / not met / open (too few seeds yet: `SEEDS_WANTED`), with
    the numbers, on greedy accuracy and sampled pass@1 alike."""
    lines = ["**Goals** (held-out accuracy at the last step, greedy and pass@1; met or not met "
             f"once the arms' seeds are in — {DEFAULT_SEEDS}, or {LATER_SEEDS} for "
             f"{', '.join(ARM_LABELS[a] for a in SEEDS_WANTED)} — open before)", ""]  # fmt: skip

    def verdict(ok: bool, seeds: int, *names: str) -> str:
        wanted = max((SEEDS_WANTED.get(n, DEFAULT_SEEDS) for n in names), default=DEFAULT_SEEDS)
        return ("met" if ok else "not met") if seeds >= wanted else "open"

    for arm in arms.values():
        last, verdicts, numbers = max(arm.steps), [], []
        for name, metric in METRICS:
            final, base = arm.values(last, metric), [metric(b) for b in bases.values()]
            gain, noise = compare(final, base)
            verdicts.append(gain > noise)
            numbers.append(f"{name} {fmt(final)} against base {fmt(base)} (gain {gain:+.3f}, "
                           f"spread {noise:.3f})")  # fmt: skip
        outcome = verdict(all(verdicts), len(arm.seeds), arm.name)
        lines.append(f"- {arm.label} above the base model by more than the seed spread: "
                     f"{outcome} — step {last}: {'; '.join(numbers)}")  # fmt: skip
    if "grpo" in arms:  # the other losses of GRPO's family against it
        for name in ("dapo", "gspo", "cispo", "sapo"):
            if name in arms:
                lines.append(ordering_goal(arms[name], arms["grpo"], verdict))
    if "dapo" in arms and "dapo_sync" in arms:
        lines += sync_goal(arms["dapo"], arms["dapo_sync"], verdict)
    if "opd" in arms and "dapo" in arms:
        lines += opd_goal(arms["opd"], arms["dapo"], verdict)
    return [*lines, ""]


def opd_goal(opd: Arm, dapo: Arm, verdict: Callable) -> list[str]:
    """On-policy distillation reaches DAPO's last-step held-out accuracy (its mean, on both
    metrics) by an evaluated step at most a third of DAPO's steps; and the student's reverse KL
    to the teacher falls (the mean of its first 4 steps against its last 4, per run)."""
    last = max(dapo.steps)
    early = [s for s in opd.steps if 0 < s <= last / 3]
    numbers, reached = [], []
    for name, metric in METRICS:
        target = spread(dapo.values(last, metric))[0]
        at = next((s for s in early if spread(opd.values(s, metric))[0] >= target), None)
        reached.append(at is not None)
        shown = at if at is not None else max(early, default=0)
        numbers.append(f"{name}: DAPO step {last} {target:.3f}, OPD step {shown} "
                       f"{fmt(opd.values(shown, metric))}")  # fmt: skip
    seeds = min(len(opd.seeds), len(dapo.seeds))
    kl = [
        (statistics.fmean(v[:4]), statistics.fmean(v[-4:]))
        for c in opd.cells
        if len(v := [s["opd/reverse_kl"] for s in c["steps"] if "opd/reverse_kl" in s]) >= 8
    ]
    falls = bool(kl) and all(b < a for a, b in kl)
    return [
        f"- OPD reaches DAPO's step-{last} held-out accuracy within a third of its steps: "
        f"{verdict(all(reached), seeds, 'opd')} — {'; '.join(numbers)}",
        f"- OPD's reverse KL to the teacher falls: {verdict(falls, len(kl), 'opd')} — first 4 → "
        f"last 4, per run: {', '.join(f'{a:.4f} → {b:.4f}' for a, b in kl) or 'not recorded'}",
    ]


def ordering_goal(first: Arm, second: Arm, verdict: Callable) -> str:
    """`first` ≥ `second` at the last step both reached: met when `first`'s mean is at least
    `second`'s on both metrics; each gap says whether it lies inside the seed spread."""
    last = min(max(first.steps), max(second.steps))
    ordered, numbers = [], []
    for name, metric in METRICS:
        a, b = first.values(last, metric), second.values(last, metric)
        gap, noise = compare(a, b)
        ordered.append(gap >= 0)
        where = "inside" if abs(gap) <= noise else "outside"
        numbers.append(f"{name} {fmt(a)} against {fmt(b)} (gap {gap:+.3f}, {where} the spread "
                       f"{noise:.3f})")  # fmt: skip
    seeds = min(len(first.seeds), len(second.seeds))
    outcome = verdict(all(ordered), seeds, first.name)  # judged on the seeds `first` needs
    return f"- {first.label} ≥ {second.label} at step {last}: {outcome} — {'; '.join(numbers)}"


def sync_goal(asynchronous: Arm, synchronous: Arm, verdict: Callable) -> list[str]:
    """Same accuracy per step (every evaluated step, both metrics, the gap inside the larger
    seed spread) and less wall-clock for the asynchronous arm, compared seed by seed: the two
    runs of a seed run back to back on one machine, where runs of different seeds may not."""
    steps = [s for s in asynchronous.steps if s in synchronous.steps and s > 0]
    worst = []  # (gap beyond the spread, |gap|, spread, metric, step)
    for step in steps:
        for name, metric in METRICS:
            gap, noise = compare(
                asynchronous.values(step, metric), synchronous.values(step, metric)
            )
            worst.append((abs(gap) - noise, abs(gap), noise, name, step))
    same = all(excess <= 0 for excess, *_ in worst)
    seeds = min(len(asynchronous.seeds), len(synchronous.seeds))
    walls = {c["seed"]: c["wall_s"] for c in asynchronous.cells}
    ratios = [c["wall_s"] / walls[c["seed"]] for c in synchronous.cells if c["seed"] in walls]
    _, gap, noise, name, step = max(worst) if worst else (0.0, 0.0, 0.0, "greedy", 0)
    return [
        f"- Synchronous and asynchronous DAPO reach the same held-out accuracy per step within "
        f"the seed spread: {verdict(same, seeds, 'dapo_sync')} — at steps "
        f"{', '.join(map(str, steps))}, the largest gap against its spread is {gap:.3f} "
        f"({name}, step {step}; spread {noise:.3f})",
        f"- Asynchronous DAPO gets there sooner: "
        f"{verdict(all(r > 1 for r in ratios), seeds, 'dapo_sync')} — "
        f"wall-clock to the last step, synchronous / asynchronous, seed by seed: "
        f"{', '.join(f'{r:.2f}' for r in ratios)} (mean {fmt(ratios, 2)})",
    ]


def render_figure(arms: list[Arm], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (("greedy accuracy", greedy), ("sampled pass@1", pass_at_1))
    figure, axes = plt.subplots(2, 2, figsize=(11, 8), sharey="row")
    for row, (name, metric) in enumerate(metrics):
        for arm in arms:
            steps = arm.steps
            means = [spread(arm.values(s, metric))[0] for s in steps]
            stds = [spread(arm.values(s, metric))[1] for s in steps]
            minutes = [spread([e["elapsed_s"] for e in arm.by_step[s]])[0] / 60 for s in steps]
            label = f"{arm.label} ({len(arm.seeds)} seed{'s' * (len(arm.seeds) > 1)})"
            for column, xs in enumerate((steps, minutes)):
                axes[row][column].errorbar(xs, means, yerr=stds, marker="o", capsize=3, label=label)
        axes[row][0].set_ylabel(f"held-out {name}")
    axes[1][0].set_xlabel("learner step")
    axes[1][1].set_xlabel("wall-clock from launch (minutes)")
    axes[0][0].legend(fontsize=8)
    figure.suptitle("SmolLM2-135M on builtin:arithmetic-test (facts never trained on)")
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)


def write_report(cells_dir: Path) -> None:
    found, bases = load_cells(cells_dir)
    arms = {name: Arm(name, found[name], bases) for name in ARM_ORDER if name in found}
    if not arms:
        print(f"report: no finished cell in {cells_dir} yet")
        return
    block = [BEGIN_MARK, "", *tables(list(arms.values())), *goals(arms, bases), END_MARK]
    text = LEARNING_MD.read_text() if LEARNING_MD.exists() else f"{BEGIN_MARK}\n{END_MARK}\n"
    if BEGIN_MARK not in text or END_MARK not in text:
        raise SystemExit(f"{LEARNING_MD} lacks the study markers; put back {BEGIN_MARK!r} and "
                         f"{END_MARK!r} where the results go")  # fmt: skip
    before, rest = text.split(BEGIN_MARK, 1)
    after = rest.split(END_MARK, 1)[1]
    LEARNING_MD.write_text(before + "\n".join(block) + after)
    render_figure(list(arms.values()), FIGURE)
    print("\n".join(block[2:-1]))
    print(f"report: {LEARNING_MD} and {FIGURE}")
