"""Where the learner's metrics go: a JSONL file in the run, wandb, and the console.

- JSONL: every step, always. Local runs append to `<run>/metrics/learner.jsonl`; object stores
  cannot append, so there each step is one object `<run>/metrics/learner-<step:08d>.json`.
  `read_metrics(run)` reads either layout back.
- wandb: online when `WANDB_API_KEY` is set, offline otherwise (`logging.wandb_mode`). The run
  id is created once and kept in `<run>/metrics/wandb.json` (create-if-absent), so a resumed
  learner continues the same wandb run. Files go to `$WANDB_DIR`, else `<run>/wandb` for a
  local run, else `./wandb`. A wandb failure never stops training: it is logged once and the
  JSONL goes on.
- Console: a progress bar (steps / total) with reward, accuracy and weight version, and an
  INFO line every `logging.log_every` steps.

Only the main rank reports (`enabled`); the others make no files and no wandb run.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from storage.fs import Location, put_if_absent
from streamrl.config import LoggingConfig

__all__ = ["MetricsReporter", "read_metrics", "wandb_mode"]

log = logging.getLogger(__name__)


def read_metrics(run: Location) -> list[dict[str, Any]]:
    """Every logged learner record in order (value pre-training first, then steps); a step
    logged twice — by a learner killed after logging it — keeps its last record."""
    fs = run.fs
    if not fs.exists(run.join("metrics")):
        return []
    lines: list[str] = []
    jsonl = run.join("metrics", "learner.jsonl")
    if fs.exists(jsonl):
        lines += fs.cat_file(jsonl).decode().splitlines()
    for path in sorted(fs.glob(run.join("metrics", "learner-*.json"))):
        lines.append(fs.cat_file(path).decode())
    records: dict[tuple[Any, Any], dict[str, Any]] = {}
    for line in lines:
        if line.strip():
            record = json.loads(line)
            records[(record.get("step"), record.get("value_pretrain_step"))] = record
    return sorted(
        records.values(), key=lambda r: (r.get("step", 0), r.get("value_pretrain_step") or 0)
    )


def wandb_mode(cfg: LoggingConfig) -> str:
    """`auto` → online with `WANDB_API_KEY`, else offline."""
    if cfg.wandb_mode != "auto":
        return cfg.wandb_mode
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


class MetricsReporter:
    """The learner's metrics sink for one run (see the module docstring)."""

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
        self.run, self.cfg, self.enabled = run, cfg, enabled
        self.total_steps = total_steps
        self._wandb: Any = None
        self._bar: Any = None
        self.wandb_url: str | None = None
        if not enabled:
            return
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
        )

    # -- wandb ----------------------------------------------------------------------------

    def _wandb_id(self) -> str:
        """The wandb run id of this streamrl run, created once."""
        path = self.run.join("metrics", "wandb.json")
        record = {"id": uuid.uuid4().hex[:16], "project": self.cfg.wandb_project}
        put_if_absent(self.run.fs, path, json.dumps(record).encode())
        return json.loads(self.run.fs.cat_file(path))["id"]

    def _start_wandb(self, config: dict[str, Any]) -> None:
        try:
            import wandb

            directory = os.environ.get("WANDB_DIR") or (
                self.run.join("wandb") if self.run.is_local else "wandb"
            )
            Path(directory).mkdir(parents=True, exist_ok=True)
            self._wandb = wandb.init(
                project=self.cfg.wandb_project,
                entity=self.cfg.wandb_entity,
                name=self.cfg.run_name or self.run.uri.rstrip("/").rsplit("/", 1)[-1],
                id=self._wandb_id(),
                resume="allow",
                mode=wandb_mode(self.cfg),
                dir=directory,
                config=config,
            )
            self.wandb_url = self._wandb.url or f"offline: {self._wandb.dir} (wandb sync)"
            self._write_link()
        except Exception as exc:  # wandb is a convenience: training goes on without it
            log.warning("wandb is off for this learner (%s: %s)", type(exc).__name__, exc)
            self._wandb = None

    def _write_link(self) -> None:
        """Record where the wandb run is, for the flow's artifacts and `streamrl status`."""
        path = self.run.join("metrics", "wandb.json")
        record = json.loads(self.run.fs.cat_file(path))
        record["url"] = self.wandb_url
        self.run.fs.pipe_file(path, json.dumps(record).encode())

    # -- per step ---------------------------------------------------------------------------

    def log(self, metrics: dict[str, Any]) -> None:
        """Report one record (a learner step, or a value pre-training step)."""
        if not self.enabled:
            return
        self._append(metrics)
        step = int(metrics.get("step", 0))
        if self._wandb is not None:
            try:
                numbers = {k: v for k, v in metrics.items() if isinstance(v, int | float)}
                self._wandb.log(numbers, step=step)
            except Exception as exc:
                log.warning("wandb logging failed; continuing without it (%s)", exc)
                self._wandb = None
        if "value_pretrain_step" in metrics:
            log.info(
                "value pre-training %d: vf_loss %.4f explained variance %.3f",
                metrics["value_pretrain_step"],
                metrics.get("critic/vf_loss", float("nan")),
                metrics.get("critic/explained_var", float("nan")),
            )
            return
        if self._bar is not None:
            self._bar.set_postfix(
                reward=f"{metrics['rollout/reward_mean']:+.3f}",
                acc=f"{metrics['rollout/acc']:.3f}",
                v=metrics.get("policy_version"),
                refresh=False,
            )
            self._bar.update(step - self._bar.n)
        if step % self.cfg.log_every == 0:
            log.info(
                "step %d: reward %.3f acc %.3f loss %.4f staleness %.2f v%d",
                step,
                metrics["rollout/reward_mean"],
                metrics["rollout/acc"],
                metrics.get("actor/pg_loss", float("nan")),
                metrics["stream/staleness_mean"],
                metrics.get("policy_version", 0),
            )

    def _append(self, metrics: dict[str, Any]) -> None:
        line = json.dumps({"time": time.time(), **metrics}) + "\n"
        fs, run = self.run.fs, self.run
        if run.is_local:
            fs.makedirs(run.join("metrics"), exist_ok=True)
            with fs.open(run.join("metrics", "learner.jsonl"), "a") as f:
                f.write(line)
            return
        name = f"learner-{int(metrics.get('step', 0)):08d}"
        if "value_pretrain_step" in metrics:
            name += f"-pretrain-{int(metrics['value_pretrain_step']):06d}"
        fs.pipe_file(run.join("metrics", f"{name}.json"), line.encode())

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._wandb is not None:
            try:
                self._wandb.finish()
            except Exception as exc:
                log.warning("wandb did not finish cleanly (%s)", exc)
            self._wandb = None

    def __enter__(self) -> MetricsReporter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
