"""Where the learner's metrics go: a JSONL file in the run, wandb, and the console.

- JSONL: every record, always. Local runs append to `<run>/metrics/learner.jsonl`; object
  stores cannot append, so there each record is one object `<run>/metrics/learner-<step:08d>.json`
  (`-pretrain-<k:06d>` added for value pre-training). `streamrl.learner.metrics_records` reads
  either layout back.
- wandb (`logging.wandb_mode`): `auto` is online when `WANDB_API_KEY` is set, else offline. The
  run id is created once and kept in `<run>/metrics/wandb.json` (create-if-absent), so a
  resumed learner continues the same wandb run; records go with `step=`, so steps a resumed
  learner logs again are not duplicated. Files go to `$WANDB_DIR`, else `<run>/wandb` for a
  local run, else `<cache>/wandb/<bucket_prefix_name>` (cache: $STREAMRL_CACHE, else
  ~/.cache/streamrl). A wandb failure never stops training: it is logged once and the JSONL
  goes on. Value pre-training records all carry step 0: wandb keeps the last, the JSONL all.
- wandb also gets a table of a few of each logged step's responses (`log_table`, from
  `streamrl.learner.sample_table.SampleTable`; `logging.log_samples`).
- Console: a progress bar on stderr (steps / total) with reward, accuracy, weight version and
  learner tokens/s, and an INFO line; wandb and the INFO line every `logging.log_every` steps
  (and at the last step).

Only the main rank reports (`enabled`); the others make no files and no wandb run.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import sys
import time
import uuid
from collections.abc import Sequence
from numbers import Real
from pathlib import Path
from typing import Any

from storage.control.credentials import without_credentials
from storage.fs import Location, put_if_absent
from streamrl.learner.config import LoggingConfig
from streamrl.learner.metrics_records import JSONL, WANDB_RECORD
from streamrl.models import cache_root

__all__ = ["MetricsReporter", "task_accuracies", "wandb_dir", "wandb_mode"]

log = logging.getLogger(__name__)


def wandb_mode(cfg: LoggingConfig) -> str:
    """`auto` → online with `WANDB_API_KEY`, else offline; other modes as configured."""
    if cfg.wandb_mode != "auto":
        return cfg.wandb_mode
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def wandb_dir(run: Location) -> Path:
    """The local folder for the run's wandb files (see the module docstring)."""
    if os.environ.get("WANDB_DIR"):
        return Path(os.environ["WANDB_DIR"])
    if run.is_local:
        return Path(run.join("wandb"))
    return cache_root() / "wandb" / run.path.strip("/").replace("/", "_")


class MetricsReporter:
    """The learner's metrics sink for one run (see the module docstring). A context manager:
    leaving it closes the bar and finishes the wandb run (as failed on an exception)."""

    def __init__(
        self,
        run: Location,
        cfg: LoggingConfig,
        *,
        config: dict[str, Any],
        total_steps: int,
        start_step: int = 0,
        enabled: bool = True,
    ) -> None:
        """`config`: the run's configuration, shown in wandb (without credential-named keys,
        whatever the caller passed; see storage.control.manifest). `start_step`: the step a resumed
        learner starts from. `enabled`: False on every rank but the main one."""
        self.run, self.cfg, self.enabled = run, cfg, enabled
        self.total_steps = total_steps
        self._wandb: Any = None
        self._wandb_url: str | None = None
        self._bar: Any = None
        if not enabled:
            return
        if run.is_local:
            _end_last_line(Path(run.join("metrics", JSONL)))
        if wandb_mode(cfg) != "disabled":
            self._start_wandb(config)
        from tqdm import tqdm

        self._bar = tqdm(
            total=total_steps,
            initial=start_step,
            desc="learner",
            unit="step",
            file=sys.stderr,
            dynamic_ncols=True,
            mininterval=0,
            disable=None,  # a terminal only: under a supervisor the INFO lines say it
        )

    @property
    def wandb_url(self) -> str | None:
        """The wandb run's link; offline, `offline: wandb sync <its folders>`; None without
        wandb (disabled, failed, or another rank)."""
        return self._wandb_url

    # -- wandb ----------------------------------------------------------------------------

    def _wandb_record(self) -> dict[str, Any]:
        """`<run>/metrics/wandb.json`: the wandb run id of this streamrl run, created once."""
        path = self.run.join("metrics", WANDB_RECORD)
        record = {"id": uuid.uuid4().hex[:16], "project": self.cfg.wandb_project}
        put_if_absent(self.run.fs, path, json.dumps(record).encode())
        return json.loads(self.run.fs.cat_file(path))

    def _start_wandb(self, config: dict[str, Any]) -> None:
        try:
            import wandb

            record, directory = self._wandb_record(), wandb_dir(self.run)
            directory.mkdir(parents=True, exist_ok=True)
            self._wandb = wandb.init(
                project=record.get("project", self.cfg.wandb_project),
                entity=self.cfg.wandb_entity,
                name=self.cfg.run_name or posixpath.basename(self.run.uri.rstrip("/")),
                id=record["id"],
                resume="allow",
                mode=wandb_mode(self.cfg),
                dir=str(directory),
                config=without_credentials(config),
            )
            if self._wandb.url:
                self._wandb_url = self._wandb.url
            else:  # offline: every life of the run has a folder ending in the same id
                folders = (
                    Path(self._wandb.settings.sync_dir).parent / f"offline-run-*-{record['id']}"
                )
                self._wandb_url = f"offline: wandb sync {folders}"
            if record.get("url") != self._wandb_url:  # changes only when the mode does
                record["url"] = self._wandb_url
                self.run.fs.pipe_file(
                    self.run.join("metrics", WANDB_RECORD), json.dumps(record).encode()
                )
        except Exception as exc:  # wandb is a convenience: training goes on without it
            log.warning(
                "wandb is off for this learner; metrics go to %s only (%s: %s)",
                self.run.join("metrics"),
                type(exc).__name__,
                exc,
            )
            self._close_wandb(failed=True)
            self._wandb_url = None

    # -- per step ---------------------------------------------------------------------------

    def log(self, metrics: dict[str, Any]) -> None:
        """Report one record: a learner step (`step`, `policy_version`, docs/algorithms.md metrics)
        or a value pre-training step (`value_pretrain_step` added, `step` 0)."""
        if not self.enabled:
            return
        self._append(metrics)
        step = int(metrics.get("step", 0))
        pretrain = "value_pretrain_step" in metrics
        due = pretrain or self._due(step)
        if due:
            self._log_wandb(metrics, step)
        if pretrain:
            log.info(
                "value pre-training %d: vf_loss %.4f explained variance %.3f",
                metrics["value_pretrain_step"],
                metrics.get("critic/vf_loss", float("nan")),
                metrics.get("critic/explained_var", float("nan")),
            )
            return
        if "sft/loss" in metrics:  # a supervised run: no rollouts
            self._log_supervised(metrics, step, due)
            return
        if "pref/loss" in metrics:  # a preference run: pairs, no rollouts
            self._log_preference(metrics, step, due)
            return
        reward = metrics.get("rollout/reward_mean", float("nan"))
        acc = metrics.get("rollout/acc", float("nan"))
        version = metrics.get("policy_version", 0)
        if self._bar is not None:
            self._bar.set_postfix(
                reward=f"{reward:+.3f}",
                acc=f"{acc:.3f}",
                v=version,
                tok_s=f"{metrics.get('perf/learner_tokens_per_s', float('nan')):.0f}",
                refresh=False,
            )
            self._bar.update(step - self._bar.n)
        if due:
            turns, calls = (
                metrics.get("rollout/turns_mean", 1.0),
                metrics.get("rollout/tool_calls_mean", 0.0),
            )
            tools = metrics.get("rollout/tools_offered_frac", 0.0) > 0  # even while unused
            agent = f" turns {turns:.2f} tools {calls:.2f}" if tools or turns > 1 or calls else ""
            if "opd/reverse_kl" in metrics:  # on-policy distillation: the student's gap
                agent += f" rkl {metrics['opd/reverse_kl']:.4f}"
            log.info(
                "step %d/%d: reward %+.3f acc %.3f%s len %.0f%s loss %.4f staleness %.2f "
                "%.0f tok/s %.0fs v%d",
                step,
                self.total_steps,
                reward,
                acc,
                task_accuracies(metrics),
                metrics.get("rollout/response_len_mean", float("nan")),
                agent,
                metrics.get("actor/pg_loss", float("nan")),
                metrics.get("stream/staleness_mean", float("nan")),
                metrics.get("perf/learner_tokens_per_s", float("nan")),
                metrics.get("perf/step_s", float("nan")),
                version,
            )

    def _log_supervised(self, metrics: dict[str, Any], step: int, due: bool) -> None:
        """A supervised step: its loss, the held-out loss when computed, the epoch."""
        loss, version = metrics["sft/loss"], metrics.get("policy_version", 0)
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", v=version, refresh=False)
            self._bar.update(step - self._bar.n)
        if not due:
            return
        heldout = metrics.get("sft/heldout_loss")
        log.info(
            "step %d/%d: loss %.4f%s epoch %.2f lr %.2e %.0f tok/s %.0fs v%d",
            step,
            self.total_steps,
            loss,
            "" if heldout is None else f" held-out {heldout:.4f}",
            metrics.get("sft/epoch", float("nan")),
            metrics.get("actor/lr", float("nan")),
            metrics.get("perf/learner_tokens_per_s", float("nan")),
            metrics.get("perf/step_s", float("nan")),
            version,
        )

    def _log_preference(self, metrics: dict[str, Any], step: int, due: bool) -> None:
        """A preference step: its loss, margin and accuracy, the held-out accuracy when
        computed, the epoch."""
        loss, version = metrics["pref/loss"], metrics.get("policy_version", 0)
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", v=version, refresh=False)
            self._bar.update(step - self._bar.n)
        if not due:
            return
        heldout = metrics.get("pref/eval_accuracy")
        log.info(
            "step %d/%d: loss %.4f margin %+.3f acc %.3f%s epoch %.2f %.0f tok/s %.0fs v%d",
            step,
            self.total_steps,
            loss,
            metrics.get("pref/margin", float("nan")),
            metrics.get("pref/accuracy", float("nan")),
            "" if heldout is None else f" held-out acc {heldout:.3f}",
            metrics.get("pref/epoch", float("nan")),
            metrics.get("perf/learner_tokens_per_s", float("nan")),
            metrics.get("perf/step_s", float("nan")),
            version,
        )

    def _due(self, step: int) -> bool:
        """Whether step `step` goes to wandb and the INFO line."""
        return step % self.cfg.log_every == 0 or step == self.total_steps

    def logs_tables(self, step: int) -> bool:
        """Whether a table of step `step` would reach wandb (`log_table`): wandb is on and the
        step is logged there."""
        return self._wandb is not None and self._due(step)

    def log_table(self, key: str, columns: Sequence[str], rows: list[list[Any]], step: int) -> None:
        """A `wandb.Table` under `key` at step `step` (after that step's `log`); nothing without
        wandb."""
        if self._wandb is None:
            return
        try:
            import wandb

            self._wandb.log({key: wandb.Table(columns=list(columns), data=rows)}, step=step)
        except Exception as exc:  # as in _log_wandb
            self._wandb_failed(exc)

    def _log_wandb(self, metrics: dict[str, Any], step: int) -> None:
        if self._wandb is None:
            return
        try:
            numbers = {k: v for k, v in metrics.items() if isinstance(v, Real)}
            self._wandb.log(numbers, step=step)
        except Exception as exc:  # as in _start_wandb: training goes on without wandb
            self._wandb_failed(exc)

    def _wandb_failed(self, exc: Exception) -> None:
        log.warning("wandb logging failed; continuing without it (%s: %s)", type(exc).__name__, exc)
        self._wandb = None

    def _append(self, metrics: dict[str, Any]) -> None:
        line = json.dumps({"time": time.time(), **metrics}, default=_plain) + "\n"
        fs, run = self.run.fs, self.run
        if run.is_local:
            fs.makedirs(run.join("metrics"), exist_ok=True)
            with fs.open(run.join("metrics", JSONL), "a") as f:
                f.write(line)
            return
        name = f"learner-{int(metrics.get('step', 0)):08d}"
        if "value_pretrain_step" in metrics:
            name += f"-pretrain-{int(metrics['value_pretrain_step']):06d}"
        fs.pipe_file(run.join("metrics", f"{name}.json"), line.encode())

    def close(self, *, failed: bool = False) -> None:
        """Close the bar and finish the wandb run (marked failed with `failed`)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._close_wandb(failed=failed)

    def _close_wandb(self, *, failed: bool = False) -> None:
        """Finish the wandb run, if one is open; the JSONL and the bar go on."""
        if self._wandb is not None:
            try:
                self._wandb.finish(exit_code=1 if failed else 0)
            except Exception as exc:  # the JSONL is complete; only wandb's copy may lag
                log.warning("wandb did not finish cleanly (%s: %s)", type(exc).__name__, exc)
            self._wandb = None

    def __enter__(self) -> MetricsReporter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        self.close(failed=exc_type is not None)


def task_accuracies(metrics: dict[str, Any], prefix: str = "task", shown: int = 6) -> str:
    """ " (leg_counting 0.41, letter_counting 0.22)": each task's accuracy (`<prefix>/<task>/acc`)
    when the metrics have two tasks or more, the first `shown` of them; "" otherwise."""
    tasks = {
        key.removeprefix(f"{prefix}/").removesuffix("/acc"): value
        for key, value in metrics.items()
        if key.startswith(f"{prefix}/") and key.endswith("/acc")
    }
    if len(tasks) < 2:
        return ""
    parts = [f"{task} {value:.2f}" for task, value in sorted(tasks.items())[:shown]]
    more = f", +{len(tasks) - shown} more" if len(tasks) > shown else ""
    return f" ({', '.join(parts)}{more})"


def _plain(value: Any) -> Any:
    """numpy and torch scalars as Python numbers for JSON."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"metric value {value!r} of type {type(value).__name__} is not a number")


def _end_last_line(jsonl: Path) -> None:
    """A learner killed mid-write left a line without its newline: end it, so the next record
    starts on a line of its own (`read_metrics` skips the cut one)."""
    if not jsonl.exists() or jsonl.stat().st_size == 0:
        return
    with jsonl.open("rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n":
            f.write(b"\n")
