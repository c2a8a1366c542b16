"""A run's learning curves: per-step series of the learner's metrics, as text charts for a
terminal and as one image (the flow run's "curves" artifact, `streamrl status --plot`).

`curve_data(records, evaluations)` turns learner records (`metrics/learner.jsonl`, see
`streamrl.learner.reporting`) and held-out evaluation records (`streamrl.evaluation`) into
`Curves`: for each metric of `CHARTS`, the steps where it was logged and its values. A step
logged twice (a resumed learner repeats the steps after its checkpoint) keeps its last record;
value pre-training records, missing metrics and non-finite values are left out. Evaluation
points sit at the step whose weights they evaluated (weight version v is published by step v).
Health conditions that fired (`streamrl.learner.health`, the records' `health` lists) are kept as
(step, condition) marks.

`text_charts` draws each chart as a sparkline with its first and last values; `render_png`
draws all of them with matplotlib (imported only there). `RunCurves` keeps a run's curves up
to date from its storage, reading only what was logged since its last read.
"""

from __future__ import annotations

import io
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from storage.fs import Location
from streamrl.evaluation.records import read_eval_records
from streamrl.learner.metrics_records import MetricsFollower

__all__ = [
    "CHARTS",
    "Chart",
    "Curves",
    "RunCurves",
    "curve_data",
    "curve_fields",
    "render_png",
    "sparkline",
    "text_charts",
]


@dataclass(frozen=True)
class Chart:
    """One small chart: `series` are (metric, legend label) pairs; `fmt` formats a value."""

    title: str
    series: tuple[tuple[str, str], ...]
    fmt: str = "{:.3f}"

    @property
    def metrics(self) -> tuple[str, ...]:
        return tuple(metric for metric, _ in self.series)


# What people watch during RL training, in reading order.
CHARTS = (
    Chart("reward (mean)", (("rollout/reward_mean", "consumed groups"),), "{:+.3f}"),
    Chart(
        "supervised loss",
        (("sft/loss", "train"), ("sft/heldout_loss", "held-out")),
        "{:.4f}",
    ),
    Chart(
        "preference accuracy",
        (("pref/accuracy", "train"), ("pref/eval_accuracy", "held-out")),
    ),
    Chart("preference margin", (("pref/margin", "train"), ("pref/eval_margin", "held-out"))),
    Chart(
        "accuracy",
        (("rollout/acc", "consumed groups"), ("rollout_accepted/acc", "trained groups")),
    ),
    Chart("response length (mean)", (("rollout/response_len_mean", "tokens"),), "{:.0f}"),
    Chart("truncated fraction", (("rollout/truncated_frac", "truncated"),), "{:.0%}"),
    Chart("entropy", (("actor/entropy", "per token"),)),
    Chart("policy loss", (("actor/pg_loss", "pg loss"),), "{:+.4f}"),
    Chart(
        "policy-loss clipping",
        (("actor/clip_frac", "clipped fraction"), ("actor/gate_weight_mean", "SAPO gate weight")),
        "{:.3f}",
    ),
    Chart(
        "distillation: reverse KL to the teacher",
        (("opd/reverse_kl", "per token"),),
        "{:.4f}",
    ),
    Chart(
        "teacher log-prob and time",
        (
            ("opd/teacher_logp_mean", "log-prob per token"),
            ("rollout/teacher_s_per_group", "s/group"),
        ),
        "{:.3f}",
    ),
    Chart("gradient norm", (("actor/grad_norm", "before clipping"),)),
    Chart("KL to the reference", (("actor/ref_kl", "KL"),), "{:.4f}"),
    Chart(
        "generator–learner mismatch (k3 KL)",
        (("mismatch/kl_k3", "all groups"), ("mismatch/kl_k3_fresh", "fresh groups")),
        "{:.2e}",
    ),
    Chart(
        "importance ratio",
        (("mismatch/ratio_max", "token max"), ("mismatch/seq_ratio_max", "response max")),
        "{:.2f}",
    ),
    Chart(
        "staleness", (("stream/staleness_mean", "mean"), ("stream/staleness_max", "max")), "{:.1f}"
    ),
    Chart("waste fraction", (("stream/waste_frac", "consumed, not trained"),), "{:.0%}"),
    Chart("learner tokens/s", (("perf/learner_tokens_per_s", "tokens/s"),), "{:.0f}"),
    Chart("step time (s)", (("perf/step_s", "seconds"),), "{:.1f}"),
)
EVAL_CHART = Chart("held-out evaluation", (), "{:.3f}")  # its series: the run's val/* metrics

_CHART_METRICS = frozenset(metric for chart in CHARTS for metric in chart.metrics)
_TICKS = "▁▂▃▄▅▆▇█"


@dataclass
class Curves:
    """Series by metric: (steps, values), steps increasing. `evaluations`: the same for
    held-out metrics (`val/acc_greedy`, `val/avg@k`), by the step of the weights evaluated.
    `health`: (step, condition) for each health condition that fired."""

    series: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    evaluations: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    health: list[tuple[int, str]] = field(default_factory=list)

    @property
    def first_step(self) -> int:
        return min((steps[0] for steps, _ in self.series.values() if steps), default=0)

    @property
    def last_step(self) -> int:
        return max((steps[-1] for steps, _ in self.series.values() if steps), default=0)

    def __bool__(self) -> bool:
        return any(steps for steps, _ in self.series.values())


def curve_fields(record: dict[str, Any]) -> dict[str, Any]:
    """The part of a learner record the curves use (to keep a long run's history small)."""
    keep = {"step", "value_pretrain_step", "health", *_CHART_METRICS}
    return {key: value for key, value in record.items() if key in keep}


def curve_data(
    records: Iterable[dict[str, Any]], evaluations: Iterable[dict[str, Any]] = ()
) -> Curves:
    """The curves of learner `records` (in the order they were written) and evaluation
    records (see the module docstring)."""
    by_step: dict[int, dict[str, Any]] = {}
    for record in records:
        if "value_pretrain_step" in record or "step" not in record:
            continue
        by_step[int(record["step"])] = record  # a step logged again: the last record wins
    curves = Curves()
    for step in sorted(by_step):
        record = by_step[step]
        for metric in _CHART_METRICS:
            value = _number(record.get(metric))
            if value is not None:
                steps, values = curves.series.setdefault(metric, ([], []))
                steps.append(step)
                values.append(value)
        for event in record.get("health") or ():
            curves.health.append((step, str(event.get("condition", "?"))))
    by_version: dict[int, dict[str, Any]] = {}
    for record in evaluations:
        if "version" in record:
            by_version[int(record["version"])] = record  # evaluated again: the last wins
    for version in sorted(by_version):
        for metric, raw in by_version[version].items():
            value = _number(raw)
            if _is_eval_score(metric) and value is not None:
                steps, values = curves.evaluations.setdefault(metric, ([], []))
                steps.append(version)
                values.append(value)
    return curves


class RunCurves:
    """The curves of the run at `run`, kept up to date: `read()` takes the learner records
    logged since its last call (and returns them); `curves()` draws on every step read so far
    (only the fields the charts use are kept) and the run's evaluations."""

    def __init__(self, run: Location) -> None:
        self.run = run
        self._follower = MetricsFollower(run)
        self._steps: dict[int, dict[str, Any]] = {}

    def read(self) -> list[dict[str, Any]]:
        records = self._follower.read()
        for record in records:
            if "value_pretrain_step" not in record and "step" in record:
                self._steps[int(record["step"])] = curve_fields(record)
        return records

    def curves(self) -> Curves:
        return curve_data(self._steps.values(), read_eval_records(self.run))


def _is_eval_score(metric: str) -> bool:
    return metric == "val/acc_greedy" or metric.startswith("val/avg@")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


# -- text ----------------------------------------------------------------------------------


def sparkline(values: Sequence[float], width: int = 40) -> str:
    """`values` as a row of block characters, at most `width` wide (longer series are
    averaged over equal runs of points); a flat series is drawn at mid height."""
    if not values:
        return ""
    if len(values) > width:
        edges = [round(i * len(values) / width) for i in range(width + 1)]
        values = [sum(values[a:b]) / (b - a) for a, b in itertools.pairwise(edges) if b > a]
    low, high = min(values), max(values)
    if high - low <= 1e-12 * max(1.0, abs(high)):
        return _TICKS[len(_TICKS) // 2 - 1] * len(values)
    scale = (len(_TICKS) - 1) / (high - low)
    return "".join(_TICKS[round((v - low) * scale)] for v in values)


def text_charts(curves: Curves, titles: Sequence[str] | None = None, width: int = 32) -> list[str]:
    """One line per chart series — title, sparkline `width` wide, first → last value, range —
    then held-out evaluation lines and where health conditions fired. `titles`: only those
    charts (default: all)."""
    lines: list[str] = []
    longest = max(
        (len(v) for _, v in [*curves.series.values(), *curves.evaluations.values()]), default=0
    )
    width = min(width, longest)  # a short run's charts are as wide as its steps
    for chart in CHARTS:
        if titles is not None and chart.title not in titles:
            continue
        for metric, label in chart.series:
            if metric in curves.series:
                name = chart.title if len(chart.series) == 1 else f"{chart.title} ({label})"
                lines.append(_text_line(name, curves.series[metric][1], chart.fmt, width))
    if titles is None or EVAL_CHART.title in titles:
        for metric, (steps, values) in sorted(curves.evaluations.items()):
            name = f"held-out {metric.removeprefix('val/')}"
            lines.append(_text_line(name, values, "{:.3f}", width) + f"  ({len(steps)} evals)")
    if curves.health and titles is None:
        fired = ", ".join(f"{condition} at step {step}" for step, condition in curves.health)
        lines.append(f"health: {fired}")
    return lines


def _text_line(name: str, values: list[float], fmt: str, width: int) -> str:
    first, last, low, high = (
        fmt.format(v) for v in (values[0], values[-1], min(values), max(values))
    )
    return f"{name:<26} {sparkline(values, width):<{width}}  {first} → {last}  [{low} .. {high}]"


# -- image ---------------------------------------------------------------------------------


def render_png(curves: Curves, title: str = "", *, columns: int = 3, dpi: int = 72) -> bytes:
    """Every chart with data (and the held-out evaluation, when there is some) in a grid, the
    steps where health conditions fired marked by red dotted lines; a PNG image."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    charts = [c for c in CHARTS if any(m in curves.series for m in c.metrics)]
    panels: list[tuple[Chart, dict[str, tuple[list[int], list[float]]]]] = [
        (c, {label: curves.series[m] for m, label in c.series if m in curves.series})
        for c in charts
    ]
    if curves.evaluations:
        panels.append((EVAL_CHART, {m[4:]: s for m, s in sorted(curves.evaluations.items())}))
    rows = max(1, math.ceil(len(panels) / columns))
    figure = Figure(figsize=(4.2 * columns, 2.6 * rows + 0.6), dpi=dpi, layout="constrained")
    FigureCanvasAgg(figure)
    if title:
        figure.suptitle(title, fontsize=12)
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    fired = sorted({step for step, _ in curves.health})
    for ax, (chart, series) in zip(axes, panels, strict=False):
        for label, (steps, values) in series.items():
            marker = "o" if chart is EVAL_CHART or len(steps) < 30 else None
            ax.plot(steps, values, marker=marker, markersize=3, linewidth=1.3, label=label)
        for step in fired:
            ax.axvline(step, color="tab:red", linestyle=":", linewidth=1.0)
        ax.set_title(chart.title, fontsize=10)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=7, loc="best")
    for ax in axes[len(panels) :]:
        ax.set_axis_off()
    if not panels:
        axes[0].text(0.5, 0.5, "no learner steps yet", ha="center", va="center")
    if curves.health:
        marks = ", ".join(f"{condition} (step {step})" for step, condition in curves.health)
        figure.supxlabel(f"red dotted lines: health conditions fired — {marks}", fontsize=8)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()
