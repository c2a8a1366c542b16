"""The learner loop: stream in, weights and checkpoints out.

Consumes: the run's replay stream, from the cursor of the latest committed checkpoint.
Produces: a weight version every `publish_every` steps (the generators load it), a checkpoint
every `checkpoint_every` steps and at the end (model, optimiser, step, policy version, stream
cursor, filter totals, RNG), one JSON line of metrics per step in `<run>/metrics/learner.jsonl`,
and the run's stop marker when `total_steps` is reached.
Waits for: B accepted groups; the stream reader blocks, and `stream_timeout_s` without a new
group is an error naming the cursor.

Resume is exact: parameters, optimiser, version, cursor and RNG come from the checkpoint, and a
weight version that an earlier life already published is not published again (the same steps
on the same stream produce the same weights).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict

import numpy as np

from storage.checkpoints import CheckpointStore, LearnerState, ModelState
from storage.control import request_stop
from storage.fs import Location
from storage.records import Cursor
from storage.stream import StreamReader
from storage.weights import WeightStore
from streamrl.config import RunConfig
from streamrl.learner.batching import (
    BatchCollector,
    FilterCounts,
    StreamBatch,
    TrainBatch,
    make_mini_batches,
)
from streamrl.learner.model import full_state_dict, load_policy, shard_model
from streamrl.learner.optim import build_optimizer, build_scheduler
from streamrl.learner.step import StepSettings, train_on_batch
from streamrl.learner.topology import Topology

__all__ = ["Learner", "rollout_metrics"]

log = logging.getLogger(__name__)


def rollout_metrics(batch: StreamBatch) -> dict[str, float]:
    """rollout/* metrics of the accepted groups (ALGORITHMS.md names)."""
    rewards = np.concatenate([g.rewards for g in batch.groups])
    scores = np.concatenate([g.raw_scores for g in batch.groups])
    lengths = np.concatenate([g.response_lengths for g in batch.groups])
    truncated = np.concatenate([g.truncated for g in batch.groups])
    return {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/acc": float((scores >= 1.0).mean()),
        "rollout/response_len_mean": float(lengths.mean()),
        "rollout/truncated_frac": float(truncated.mean()),
    }


class Learner:
    """One learner process (a rank of the torchrun job); `run()` trains to `total_steps`."""

    def __init__(self, config: RunConfig, run: Location, topology: Topology) -> None:
        self.config, self.run_location, self.topology = config, run, topology
        cfg = config.learner
        model = load_policy(config.model.path, config.model)
        self.vocab_size = model.config.vocab_size
        self.model = shard_model(model, topology, cfg.mixed_precision, cfg.activation_checkpointing)
        self.optimizer = build_optimizer(
            self.model.parameters(), cfg.lr, cfg.weight_decay, cfg.betas, cfg.eps
        )
        self.scheduler = build_scheduler(
            self.optimizer,
            cfg.warmup_steps,
            cfg.total_steps * cfg.updates_per_batch,  # the schedule counts optimiser updates
            cfg.schedule,
            cfg.min_lr_ratio,
        )
        self.weights = WeightStore(run)
        self.checkpoints = CheckpointStore(run)
        self.settings = StepSettings(
            temperature=config.generator.temperature,
            max_response_len=config.generator.max_tokens,
            logprob_chunk_tokens=cfg.logprob_chunk_tokens,
            grad_clip=cfg.grad_clip,
        )
        self.step, self.version, cursor, totals = 0, 0, Cursor(), FilterCounts()
        latest = self.checkpoints.latest_committed()
        if latest is not None:
            state = self.checkpoints.load(latest, self._app_state())
            self.step, self.version = state.step, state.policy_version
            cursor = Cursor.from_dict(state.stream_cursor)
            totals = FilterCounts(**state.extra.get("filter_totals", {}))
            log.info("resumed at step %d, version %d, stream %s", self.step, self.version, cursor)
        self.reader = StreamReader(run, cursor)
        self._groups = self.reader.groups(timeout_s=cfg.stream_timeout_s)
        self.collector = BatchCollector(
            batch_groups=cfg.batch_groups,
            max_staleness=cfg.max_staleness,
            dynamic_sampling=config.algorithm.dynamic_sampling,
            vocab_size=self.vocab_size,
            max_seq_len=config.model.max_model_len,
            totals=totals,
        )

    def _app_state(self) -> dict[str, ModelState]:
        return {"policy": ModelState(self.model, self.optimizer)}

    def run(self) -> int:
        """Train until `total_steps`, then checkpoint, publish and stop the generators."""
        cfg = self.config.learner
        while self.step < cfg.total_steps:
            self.train_step()
        if self.topology.is_main:
            request_stop(self.run_location, f"learner reached {cfg.total_steps} steps")
        return self.step

    def train_step(self) -> dict[str, float]:
        """Collect a batch, update, then publish / checkpoint / log as scheduled."""
        cfg, started = self.config.learner, time.perf_counter()
        batch = self.collector.collect(self._groups, lambda: self.reader.cursor, self.version)
        train = TrainBatch.from_groups(batch.groups)
        mini_batches = make_mini_batches(
            train,
            cfg.mini_batch_groups,
            cfg.micro_batch_tokens,
            overlong_filter=self.config.algorithm.overlong.filter,
        )
        metrics = train_on_batch(
            self.model,
            self.optimizer,
            self.scheduler,
            train,
            mini_batches,
            self.config.algorithm,
            self.settings,
            self.topology,
        )
        self.step += 1
        step_s = time.perf_counter() - started
        tokens = sum(m.num_loss_tokens for m in mini_batches)
        metrics.update(batch.metrics() | rollout_metrics(batch))
        metrics.update({"perf/step_s": step_s, "perf/learner_tokens_per_s": tokens / step_s})
        if self.step % cfg.publish_every == 0:
            metrics["perf/weight_sync_s"] = self._publish()
        if self.step % cfg.checkpoint_every == 0 or self.step == cfg.total_steps:
            self._checkpoint(batch)
        metrics.update({"step": self.step, "policy_version": self.version})
        self.topology.main_only(lambda: self._log(metrics))
        return metrics

    def _publish(self) -> float:
        """Gather the full weights and publish the next version; seconds taken."""
        started = time.perf_counter()
        state = full_state_dict(self.model, self.topology)
        version = self.version + 1

        def publish() -> None:
            if version in self.weights.versions():  # an earlier life of this run published it
                log.info("weights v%d already published; not publishing again", version)
                return
            self.weights.publish(version, state, shard_bytes=self.config.storage.weight_shard_bytes)
            self.weights.retain(self.config.storage.keep_weight_versions)

        self.topology.decide_on_main(publish)
        self.version = version
        return time.perf_counter() - started

    def _checkpoint(self, batch: StreamBatch) -> None:
        state = LearnerState(
            step=self.step,
            policy_version=self.version,
            stream_cursor=batch.cursor_after.to_dict(),
            extra={"filter_totals": asdict(self.collector.totals)},
        )
        self.checkpoints.save(self._app_state(), state)
        self.checkpoints.retain(self.config.learner.keep_checkpoints)

    def _log(self, metrics: dict[str, float]) -> None:
        path = self.run_location.join("metrics", "learner.jsonl")
        line = json.dumps({"time": time.time(), **metrics}) + "\n"
        fs = self.run_location.fs
        if self.run_location.is_local:
            fs.makedirs(self.run_location.join("metrics"), exist_ok=True)
            with fs.open(path, "a") as f:
                f.write(line)
        else:  # object stores cannot append: one object per step
            fs.pipe_file(self.run_location.join("metrics", f"learner-{self.step:08d}.json"), line)
        log.info(
            "step %d: reward %.3f acc %.3f loss %.4f staleness %.2f v%d",
            self.step,
            metrics["rollout/reward_mean"],
            metrics["rollout/acc"],
            metrics["actor/pg_loss"],
            metrics["stream/staleness_mean"],
            self.version,
        )
