"""The flow run's artifacts — learner progress, a table of the latest metrics, the learning
curves, a few of the model's responses, the wandb link — and the run's health events.

`RunArtifacts.refresh()` reads the learner records logged since its last call straight from
storage and updates what changed: the progress artifact (learner steps / total); when a new
step arrived, the markdown table (Prefect keeps every version of a keyed artifact; the table
also shows the generators' failed reward calls, tallied from the stream's commit records) and,
at most every `CURVES_EVERY_S`, the curves (`streamrl.runs.curves`: one chart grid, as an image in a
markdown artifact), and the samples: `logging.log_samples` responses of the batch the latest
logged step trained on, decoded from the replay stream — the ones the learner's wandb table shows
(`streamrl.runs.samples.StepSampler`, which reads only what is new), each text cut to
`SAMPLE_MAX_CHARS` — also at most every `CURVES_EVERY_S`. Keys come from the run's name
(`streamrl-<name>-metrics`, `-curves`, `-samples`, `-progress`, `-wandb`), so they read well and
stay the same when the run moves to S3.

Each health condition a new learner record reports (`streamrl.learner.health`) becomes a Prefect
event `streamrl.health.<condition>` (resource `streamrl.run.<name>`, related to the flow run;
payload: the step, the value, the threshold and the message), for automations to notify, pause or
cancel.
"""

from __future__ import annotations

import base64
import logging
import math
import posixpath
import re
import time
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    update_progress_artifact,
)
from prefect.client.orchestration import get_client
from prefect.events import emit_event

from storage.fs import Location
from streamrl.config.run import RunConfig
from streamrl.evaluation.records import read_eval_records
from streamrl.learner.metrics_records import read_wandb_link
from streamrl.learner.sample_table import SAMPLE_MAX_CHARS
from streamrl.learner.samples import SampleDecoder
from streamrl.models import BUNDLED_MODELS, ModelPathError, is_prepared
from streamrl.runs.curves import Curves, RunCurves, render_png
from streamrl.runs.samples import StepSampler
from streamrl.runs.samples_format import samples_markdown
from streamrl.runs.status import StreamStatus, read_stream

__all__ = ["RunArtifacts", "artifact_key", "curves_markdown", "metrics_table", "run_name"]

CURVES_EVERY_S = 60.0  # the curves image (and the samples) at most this often while steps arrive

log = logging.getLogger(__name__)

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


def run_name(config: RunConfig, run: Location) -> str:
    """What the run is called: `logging.run_name`, else the last part of its URI (the same on
    local disk and on S3)."""
    return config.logging.run_name or posixpath.basename(run.uri.rstrip("/")) or "run"


def _slug(name: str) -> str:
    """`name` in lowercase letters, digits and dashes (what Prefect artifact keys allow)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:60].strip("-") or "run"


def artifact_key(name: str, kind: str) -> str:
    """The key of the `kind` artifact of the run called `name`."""
    return f"streamrl-{_slug(name)}-{kind}"


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


def curves_markdown(curves: Curves, name: str, total_steps: int) -> str:
    """The curves as one PNG chart grid embedded in markdown (a data URI: the Prefect UI shows
    it without any other server), and the health conditions that fired."""
    title = f"{name} — step {curves.last_step} / {total_steps}"
    image = base64.b64encode(render_png(curves, title)).decode()
    lines = [f"### Curves of {title}", "", f"![curves of {name}](data:image/png;base64,{image})"]
    if curves.health:
        lines += ["", "Health conditions fired (red dotted lines; Prefect events "
                  "`streamrl.health.<condition>`):"]  # fmt: skip
        lines += [f"- step {step}: {condition}" for step, condition in curves.health]
    return "\n".join(lines)


def _position(record: dict[str, Any]) -> tuple[int, int]:
    """Where a learner record sits: value pre-training (step 0, k) before the steps."""
    return int(record.get("step", 0)), int(record.get("value_pretrain_step") or 0)


def _latest_eval(run: Location) -> dict[str, Any] | None:
    records = read_eval_records(run)
    return records[-1] if records else None


@dataclass
class RunArtifacts:
    """The artifacts and health events of one flow run for one streamrl run."""

    config: RunConfig
    run: Location
    wandb_url: str | None = None
    curves_every_s: float = CURVES_EVERY_S
    name: str = field(init=False)
    _history: RunCurves = field(init=False)
    _latest: dict[str, Any] | None = field(default=None, init=False)
    _read_once: bool = field(default=False, init=False)
    _progress_id: UUID | None = field(default=None, init=False)
    _progress: float | None = field(default=None, init=False)
    _shown: tuple[int, int] | None = field(default=None, init=False)  # the table's record
    _curves_step: int = field(default=-1, init=False)
    _curves_at: float = field(default=-math.inf, init=False)
    _curves_id: UUID | None = field(default=None, init=False)
    _stream: StreamStatus | None = field(default=None, init=False)
    _samples_step: int = field(default=-1, init=False)
    _samples_at: float = field(default=-math.inf, init=False)
    _sampler: StepSampler | None = field(default=None, init=False)
    _samples_off: bool = field(default=False, init=False)  # the tokenizer is not on this machine

    def __post_init__(self) -> None:
        self.name = run_name(self.config, self.run)
        self._history = RunCurves(self.run)

    def refresh(self, *, final: bool = False) -> dict[str, Any] | None:
        """Read the records logged since the last call; update what changed: progress, the
        metrics table (a new record, or `final`: the run is over and evaluation may have finished
        since), the curves (a new step, at most every `curves_every_s`, and when `final`); emit
        an event for each health condition the new records report. Returns the latest learner
        record (None before the first step)."""
        total = self.config.learner.total_steps
        self.link_wandb(read_wandb_link(self.run))
        self._take(self._history.read())
        step = int(self._latest["step"]) if self._latest else 0
        self._update_progress(100.0 * min(step, total) / total)
        if self._latest is not None and (_position(self._latest) != self._shown or final):
            self._shown = _position(self._latest)
            self._stream = read_stream(self.run, since=self._stream)  # new commits only
            create_markdown_artifact(
                markdown=metrics_table(self._latest, total, _latest_eval(self.run), self._stream),
                key=artifact_key(self.name, "metrics"),
                description=f"latest metrics of {self.run.uri}",
            )
        due = time.monotonic() - self._curves_at >= self.curves_every_s
        if step > 0 and ((step != self._curves_step and due) or final):
            self._publish_curves(step)
        logged = self._logged_step(step)
        samples_due = time.monotonic() - self._samples_at >= self.curves_every_s
        if logged and ((logged != self._samples_step and samples_due) or final):
            self._publish_samples(logged)
        return self._latest

    def _take(self, records: list[dict[str, Any]]) -> None:
        """The newest learner record; health events of new records that were not there at the
        first read (a resumed run's old ones were reported by their own flow run)."""
        for record in records:
            if "step" not in record:
                continue
            if self._latest is None or _position(record) >= _position(self._latest):
                self._latest = record  # a value pre-training record too (step 0)
            step = int(record["step"])
            if self._read_once:
                for event in record.get("health") or ():
                    self._emit_health(step, event)
        self._read_once = True

    def _emit_health(self, step: int, event: dict[str, Any]) -> None:
        condition = str(event.get("condition", "unknown"))
        emit_event(
            event=f"streamrl.health.{condition}",
            resource={
                "prefect.resource.id": f"streamrl.run.{_slug(self.name)}",
                "prefect.resource.name": self.name,
                "streamrl.run-uri": self.run.uri,
            },
            payload={**event, "step": step, "run_uri": self.run.uri},
        )

    def _update_progress(self, progress: float) -> None:
        """Create the progress artifact once, then update it only when it moved (each update is
        an event that `prefect deployment run --watch` prints)."""
        if self._progress_id is None:
            self._progress_id = create_progress_artifact(
                progress=progress,
                key=artifact_key(self.name, "progress"),
                description=f"learner steps of {self.run.uri}",
            )
        elif progress != self._progress:
            update_progress_artifact(self._progress_id, progress)
        self._progress = progress

    def _publish_curves(self, step: int) -> None:
        """A new version of the curves artifact; the one it replaces is deleted (each holds
        the whole history: older versions would only fill the server's database)."""
        markdown = curves_markdown(
            self._history.curves(), self.name, self.config.learner.total_steps
        )
        artifact = create_markdown_artifact(
            markdown=markdown,
            key=artifact_key(self.name, "curves"),
            description=f"learning curves of {self.run.uri}",
        )
        if self._curves_id is not None:
            with get_client(sync_client=True) as client:
                client.delete_artifact(self._curves_id)
        self._curves_id, self._curves_step, self._curves_at = artifact, step, time.monotonic()

    def _logged_step(self, step: int) -> int:
        """The newest step the learner logs to wandb (with its samples table) up to `step`; 0:
        none yet."""
        if step >= self.config.learner.total_steps:
            return step
        return step - step % self.config.logging.log_every

    def _publish_samples(self, step: int) -> None:
        try:
            markdown = self.samples_markdown(step)
        except Exception as exc:  # a convenience: the run and the other artifacts go on
            self._samples_off = True
            log.warning("no more samples artifacts for %s: making step %d's failed: %r",
                        self.run.uri, step, exc)  # fmt: skip
            return
        if markdown is not None:
            create_markdown_artifact(
                markdown=markdown,
                key=artifact_key(self.name, "samples"),
                description=f"responses of step {step} of {self.run.uri}",
            )
        self._samples_step, self._samples_at = step, time.monotonic()

    def samples_markdown(self, step: int) -> str | None:
        """The samples artifact of learner step `step`; None with `logging.log_samples` 0, or
        when the run's tokenizer cannot be loaded on this machine (warned once: the other
        artifacts go on)."""
        count = self.config.logging.log_samples
        if not count or self._samples_off or self.config.learner_only:  # SFT, preference: no stream
            return None
        if self._sampler is None:
            tokenizer, problem = self.config.model.tokenizer or self.config.model.path, None
            if tokenizer in BUNDLED_MODELS and not is_prepared(tokenizer):  # not built for this
                problem = f"bundled model {tokenizer} is not prepared here"
            else:
                try:
                    decoder = SampleDecoder.for_run(self.config)
                    self._sampler = StepSampler(self.run, self.config, decoder)
                except (ModelPathError, OSError) as exc:  # an artifact is a convenience
                    problem = str(exc)
            if problem is not None:
                self._samples_off = True
                log.warning(
                    "no samples artifact for %s: the run's tokenizer does not load on this "
                    "machine (%s); `streamrl samples` reads them where it does", self.run.uri,
                    problem,
                )  # fmt: skip
                return None
        samples = self._sampler.samples(step, count)
        title = (
            f"Samples of {self.name} — step {step}: {len(samples)} responses of the batch it "
            "trained on (`streamrl samples RUN --step N` shows more)"
        )
        return samples_markdown(samples, title, SAMPLE_MAX_CHARS)

    def link_wandb(self, url: str | None) -> None:
        """Attach the wandb run's link (or where its offline files are) once known."""
        if url and url != self.wandb_url:
            self.wandb_url = url
            create_link_artifact(
                link=url,
                link_text="wandb run",
                key=artifact_key(self.name, "wandb"),
                description="the learner's wandb run",
            )
