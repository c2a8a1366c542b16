"""The flow run's artifacts: learner progress, a table of the latest metrics, the wandb link.

`RunArtifacts.refresh()` reads the run's metrics straight from storage and updates the
progress artifact (learner steps / total) and, when a new step arrived, re-publishes the
markdown table under the run's key (Prefect keeps every version of a keyed artifact). The table
also shows the generators' failed reward calls, tallied from the stream's commit records.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    update_progress_artifact,
)

from storage.fs import Location
from streamrl.config import RunConfig
from streamrl.evaluation import read_eval_records
from streamrl.learner.reporting import latest_metrics, read_wandb_link
from streamrl.status import StreamStatus, read_stream

__all__ = ["RunArtifacts", "metrics_table"]

# (label, metric, format) rows of the table, in order.
ROWS = (
    ("learner step", "step", "{:.0f}"),
    ("weight version", "policy_version", "{:.0f}"),
    ("reward (mean)", "rollout/reward_mean", "{:.3f}"),
    ("accuracy", "rollout/acc", "{:.3f}"),
    ("response length (mean)", "rollout/response_len_mean", "{:.1f}"),
    ("truncated", "rollout/truncated_frac", "{:.2%}"),
    ("staleness mean / max", ("stream/staleness_mean", "stream/staleness_max"), "{:.2f} / {:.0f}"),
    ("dropped stale (total)", "stream/dropped_stale_total", "{:.0f}"),
    ("dropped zero-variance (total)", "stream/dropped_zero_var_total", "{:.0f}"),
    ("quarantined segments (total)", "stream/quarantined_total", "{:.0f}"),
    (
        "groups consumed / trained (total)",
        ("stream/consumed_total", "stream/accepted_total"),
        "{:.0f} / {:.0f}",
    ),
    ("waste: consumed, not trained", "stream/waste_frac", "{:.1%}"),
    ("learner tokens/s", "perf/learner_tokens_per_s", "{:.0f}"),
    ("step time (s)", "perf/step_s", "{:.2f}"),
    ("learner waiting for groups (s)", "perf/wait_s", "{:.2f}"),
    ("generators paused by flow control (s, total)", "generators/paused_s_total", "{:.0f}"),
    ("policy loss", "actor/pg_loss", "{:.4f}"),
    ("entropy", "actor/entropy", "{:.3f}"),
    ("value loss", "critic/vf_loss", "{:.4f}"),
    ("explained variance", "critic/explained_var", "{:.3f}"),
)


def _key(run_uri: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes."""
    slug = re.sub(r"[^a-z0-9]+", "-", run_uri.lower()).strip("-")[-40:].strip("-")
    return f"streamrl-{slug or 'run'}"


def metrics_table(
    metrics: dict[str, Any],
    total_steps: int,
    evaluation: dict[str, Any] | None = None,
    stream: StreamStatus | None = None,
) -> str:
    """A markdown table of the latest learner metrics (and evaluation, when there is one), with
    the reward failures of the commit log `stream` (in all, and per generator that had any)."""
    lines = [
        f"### streamrl — step {metrics.get('step', 0):.0f} / {total_steps}",
        "",
        "| metric | value |",
        "|---|---|",
    ]
    for label, names, fmt in ROWS:
        names = names if isinstance(names, tuple) else (names,)
        if all(n in metrics for n in names):
            lines.append(f"| {label} | {fmt.format(*(float(metrics[n]) for n in names))} |")
    if stream is not None:
        failures = "reward errors / timeouts / groups dropped"
        for who, counts in (("total", stream), *((g.writer_id, g) for g in stream.generators)):
            counted = (counts.reward_errors, counts.reward_timeouts, counts.reward_dropped_groups)
            if who == "total" or any(counted):
                lines.append(f"| {failures} ({who}) | {' / '.join(map(str, counted))} |")
    for name, value in sorted((evaluation or {}).items()):
        if name.startswith("val/"):
            lines.append(f"| {name} (v{evaluation.get('version', '?')}) | {float(value):.3f} |")
    return "\n".join(lines)


def _latest_eval(run: Location) -> dict[str, Any] | None:
    records = read_eval_records(run)
    return records[-1] if records else None


@dataclass
class RunArtifacts:
    """The artifacts of one flow run for one streamrl run."""

    config: RunConfig
    run: Location
    wandb_url: str | None = None
    _progress_id: UUID | None = field(default=None, init=False)
    _shown_step: int = field(default=-1, init=False)
    _stream: StreamStatus | None = field(default=None, init=False)

    def refresh(self, *, final: bool = False) -> dict[str, Any] | None:
        """Update progress and, if a new step was logged (or `final`: the run is over, and
        evaluation may have finished since), the metrics table; the latest learner metrics
        (None before the first step)."""
        total = self.config.learner.total_steps
        self.link_wandb(read_wandb_link(self.run))
        latest = latest_metrics(self.run)
        step = int(latest["step"]) if latest else 0
        progress = 100.0 * min(step, total) / total
        if self._progress_id is None:
            self._progress_id = create_progress_artifact(
                progress=progress,
                key=f"{_key(self.run.uri)}-progress",
                description=f"learner steps of {self.run.uri}",
            )
        else:
            update_progress_artifact(self._progress_id, progress)
        if latest is not None and (step != self._shown_step or final):
            self._shown_step = step
            self._stream = read_stream(self.run, since=self._stream)  # new commits only
            create_markdown_artifact(
                markdown=metrics_table(latest, total, _latest_eval(self.run), self._stream),
                key=f"{_key(self.run.uri)}-metrics",
                description=f"latest metrics of {self.run.uri}",
            )
        return latest

    def link_wandb(self, url: str | None) -> None:
        """Attach the wandb run's link (or where its offline files are) once known."""
        if url and url != self.wandb_url:
            self.wandb_url = url
            create_link_artifact(
                link=url,
                link_text="wandb run",
                key=f"{_key(self.run.uri)}-wandb",
                description="the learner's wandb run",
            )
