"""The learner loop: stream in, weights and checkpoints out.

Consumes: each step's batch from the run's replay stream (`StreamSource`: rank 0 reads the
stream from the cursor of the latest committed checkpoint, chooses the batch and hands it to
every rank, and records the learner's progress in `<run>/control/learner.json`).
Produces: a weight version every `publish_every` steps (each rank uploads its shard in the
background while the next step trains: `streamrl.learner.publish`), a checkpoint every
`checkpoint_every` steps and at the end (models, optimisers and the `TrainingState`: step,
policy version, stream cursor, filter totals, RNG; `streamrl.learner.checkpointing`), one JSON
line of metrics per step in `<run>/metrics/learner.jsonl` (in wandb, with a table of a few of the
step's responses: `streamrl.learner.sample_table`), and the run's stop marker when
`total_steps` is reached. Rank 0 checks each step's metrics for the health conditions
(`streamrl.learner.health`): one that becomes true is logged as a warning and recorded in the step's
metrics as `health`.
Waits for: B accepted groups; `stream_timeout_s` without a new group is an error naming the
cursor, on every rank. Unblocked by generators committing groups to the stream.

An optimiser update with a non-finite gradient norm is skipped and counted; after
`max_skipped_updates` in a row the learner fails (nothing of the diverged state is published:
the weight store also refuses NaN/inf tensors).

Models: the policy; for a KL term a reference policy (frozen initial weights, or an EMA of the
policy that is checkpointed); for VAPO a critic with its own optimiser, pre-trained on the
frozen policy's responses (`value_pretrain_steps` batches, or until explained variance reaches
`value_pretrain_target_ev`) before the first policy update, then checkpointed at step 0; with
weighted value integration (`algorithm.value_prior`) a frozen copy of the critic as
pre-training left it (V_pre, checkpointed), blended into the policy's GAE with a weight w(t)
that decays over the run and with the critic's reliability (an EMA of its explained variance,
learner state).

One learner per run: rank 0 holds the run's lease (`storage.control.lease`) from before it loads a
checkpoint until it ends; every checkpoint, weight commit, LATEST move, retention deletion and
progress or metrics record is written only after checking it still holds it (a collective
check before each step's writes), and a learner that lost it (`LeaseLostError`) stops without
writing anything more. A weight version that could not be committed fails the learner
(`PublishFailedError`, see `streamrl.learner.publish`), also while it waits for data.

Resume is exact: parameters, optimiser, version, cursor, RNG and the prompts' earlier rewards
(temporal groups) come from the checkpoint, and a weight version that an earlier life already
published is not published again (the same steps on the same stream produce the same weights).
A checkpoint written for other models (another architecture, algorithm family, critic or
reference) is refused before anything is loaded or written, naming the differences.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from storage.control.heartbeat import Heart
from storage.control.lease import RunLease
from storage.control.requests import request_stop
from storage.fs import Location, StorageError
from storage.weights.publish import WeightWriter
from streamrl.config.run import RunConfig
from streamrl.learner.batching import StreamBatch
from streamrl.learner.checkpointing import IncompatibleCheckpointError, LearnerCheckpoints
from streamrl.learner.health import HealthMonitor
from streamrl.learner.loading import build_step_models
from streamrl.learner.lora import adapter_manifest, publish_shares
from streamrl.learner.metrics_records import read_metrics
from streamrl.learner.mini_batches import TrainBatch, make_mini_batches
from streamrl.learner.publish import WeightPublisher
from streamrl.learner.reporting import MetricsReporter
from streamrl.learner.sample_table import SampleTable
from streamrl.learner.step import StepSettings, train_on_batch
from streamrl.learner.stopping import Stopping
from streamrl.learner.stream_source import StopRequested, StreamSource
from streamrl.learner.topology import Topology
from streamrl.placement.handoff import HandOffWriter
from streamrl.placement.usage import CpuMeter

__all__ = ["DivergedError", "IncompatibleCheckpointError", "Learner"]


class DivergedError(RuntimeError):
    """Too many optimiser updates in a row had a non-finite gradient norm."""


log = logging.getLogger(__name__)


class Learner:
    """One learner process (a rank of the torchrun job); `run()` trains to `total_steps`.

    Wires the models, the weight publisher, the checkpoints (`LearnerCheckpoints`: save and
    restore of the models and `state`), the stream (`StreamSource`) and the metrics reporter;
    `state` (a `TrainingState`) is where it stands: step, version, stream cursor."""

    def __init__(
        self,
        config: RunConfig,
        run: Location,
        topology: Topology,
        *,
        take_over: bool = False,
        stop: threading.Event | None = None,
    ) -> None:
        """Take the run's lease (rank 0; `take_over`: even from a live holder, see
        `storage.control.lease`), build the models and resume from the latest checkpoint. `stop`:
        set (by SIGTERM) to stop with a checkpoint (`run`)."""
        self.config, self.run_location, self.topology = config, run, topology
        grace = config.learner.stop_grace_s
        self.stopping = Stopping(stop or threading.Event(), topology, grace)
        self.last_checkpoint_s = 0.0
        self.heart = Heart(run, "learner")  # rank 0's: each step, and while it waits for data
        self.cpu = CpuMeter()  # this rank's CPU between step records
        self._collecting = threading.Event()  # the step is waiting for its groups
        self.lease: RunLease | None = None
        topology.decide_on_main(lambda: self._acquire_lease(take_over))
        try:
            self._setup()
        except BaseException:
            self._release_lease()
            raise

    def _acquire_lease(self, take_over: bool) -> None:
        self.lease = RunLease.acquire(
            self.run_location, ttl_s=self.config.learner.lease_ttl_s, take_over=take_over
        )

    def release(self) -> None:
        """Stop reading the stream and give the run's lease up (rank 0): a successor may start
        at once. Idempotent."""
        if self.stream is not None:
            self.stream.close()
        if getattr(self, "publisher", None) is not None:
            self.publisher.close()
        self._release_lease()

    def _release_lease(self) -> None:
        self.stopping.close()
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def _setup(self) -> None:
        config, run, topology = self.config, self.run_location, self.topology
        self.models, self.shared_prompt = build_step_models(config, topology)
        self.weights = WeightWriter(run, fence=self.lease)
        lora, lora_publish = config.model.lora, config.weights.lora_publish
        self.publisher = WeightPublisher(
            self.weights,
            topology,
            config.weights,
            getattr(torch, config.weights.resolved_dtype(config.model)),
            model_config=adapter_manifest(config.model, lora_publish),
            shares=publish_shares(lora, lora_publish),
            handoff=HandOffWriter.if_placed(
                run.uri, topology.rank, topology.world_size, topology.device
            ),
        )
        self.checkpoints = LearnerCheckpoints(config, run, topology, self.models, self.lease)
        self.settings = StepSettings.from_config(config)
        self.state = self.checkpoints.restore()
        self.reporter = MetricsReporter(
            run,
            config.logging,
            config=config.model_dump(mode="json"),
            total_steps=config.learner.total_steps,
            start_step=self.state.step,
            enabled=topology.is_main,
        )
        self.health = self._health_monitor() if topology.is_main else None
        self.samples = SampleTable(config, self.reporter)  # rank 0's reporter alone logs it
        self.stream = self._data_source()

    def _data_source(self) -> StreamSource | None:
        """Where the batches come from: the run's replay stream."""
        return StreamSource(
            self.config,
            self.run_location,
            self.topology,
            self.state,
            vocab_size=self.models.policy.model.config.vocab_size,
            lease=self.lease,
            while_waiting=self._while_waiting,
        )

    def _health_monitor(self) -> HealthMonitor:
        """Rank 0's health conditions; a resumed learner's baselines and windows carry on from
        the run's records of the steps up to its checkpoint."""
        config = self.config
        monitor = HealthMonitor(
            config.health,
            max_tokens=config.generator.max_tokens,
            max_staleness=config.learner.max_staleness,
        )
        if self.state.step > 0:
            try:
                records = read_metrics(self.run_location)
            except (OSError, StorageError) as exc:  # advisory: only the baselines start afresh
                log.warning(
                    "could not read the run's metrics; health baselines start afresh: %r", exc
                )
            else:
                monitor.seed(r for r in records if r.get("step", 0) <= self.state.step)
        return monitor

    def run(self) -> int:
        """Train until `total_steps`, then checkpoint, publish and stop the generators; the
        run's lease is released at the end (also on an error).

        Once `stop` is set (SIGTERM: a preempted machine, a supervisor stopping the run) the
        step in hand is finished — or, still waiting for its data, abandoned — and with
        `learner.checkpoint_on_stop` a checkpoint of the last finished step is committed
        within `learner.stop_grace_s`; then `StopRequested` is raised."""
        cfg = self.config.learner
        try:
            with self.reporter:
                if not self.state.value_pretrained:
                    self.pretrain_value()
                while self.state.step < cfg.total_steps:
                    if self.topology.decide_on_main(self.stopping.requested):
                        raise StopRequested(f"stopped after step {self.state.step}")
                    self.train_step()
            self.publisher.flush()  # the last version is committed before the generators stop
            self._guard()
            if self.topology.is_main:
                request_stop(self.run_location, f"learner reached {cfg.total_steps} steps")
        except StopRequested:
            self._checkpoint_on_stop()
            raise
        finally:
            self.release()
        return self.state.step

    def _while_waiting(self) -> None:
        """Rank 0, while the stream has nothing new: a failed publish fails the learner; a stop
        abandons the wait."""
        self.publisher.check_failed()
        if self._collecting.is_set():  # the step's own wait, not a reader idle behind a hang
            self.heart.beat("waiting for data")
        if self.stopping.requested():
            raise StopRequested("stopped while waiting for data")

    def _checkpoint_on_stop(self) -> None:
        """Commit a checkpoint of the last finished step, unless one exists, it is turned off,
        or it would not fit in what is left of `stop_grace_s` (a checkpoint takes about as
        long as the last one did); a checkpoint cut off half-way is never committed."""
        cfg, step = self.config.learner, self.state.step
        if not cfg.checkpoint_on_stop or not self.state.value_pretrained or step == 0:
            return
        if self.checkpoints.last_saved_step == step:
            log.info("stopped at step %d, which is checkpointed", step)
            return
        deadline = self.stopping.deadline or time.monotonic() + cfg.stop_grace_s
        left = self.topology.decide_on_main(lambda: deadline - time.monotonic())
        if left < 1.2 * self.last_checkpoint_s:
            log.warning(
                "stopped at step %d with %.0f s of learner.stop_grace_s left, less than a "
                "checkpoint takes (%.0f s): not saved; a resume starts from step %s",
                step, left, self.last_checkpoint_s, self.checkpoints.last_saved_step,
            )  # fmt: skip
            return
        self._checkpoint()
        log.warning("stopped: checkpoint of step %d committed; a resume loses nothing", step)

    def _guard(self) -> None:
        """Every rank, before the learner writes the run: fail (`LeaseLostError`) if rank 0 no
        longer holds the run's lease (a collective, so every rank stops together)."""
        self.topology.decide_on_main(lambda: self.lease.check() if self.lease else None)

    def pretrain_value(self) -> list[dict[str, float]]:
        """VAPO value pre-training: critic-only steps on the frozen policy's responses until
        `value_pretrain_steps` or `value_pretrain_target_ev`; then a checkpoint at step 0.
        Returns each step's metrics. (A learner killed before that checkpoint starts over.)"""
        algorithm, history = self.config.algorithm, []
        for k in range(algorithm.value_pretrain_steps):
            batch, metrics = self._train_batch(train_policy=False)
            metrics.update({"step": self.state.step, "value_pretrain_step": k + 1})
            self.stream.write_progress(batch)
            history.append(metrics)
            self.reporter.log(metrics)
            if metrics["critic/explained_var"] >= algorithm.value_pretrain_target_ev:
                break
        self.state.value_pretrained = True
        if self.models.value_prior is not None:  # V_pre: the critic as pre-training left it
            self.models.value_prior.freeze(self.models.critic.model)
        if history:
            self._checkpoint()
        return history

    def _train_batch(
        self, *, train_policy: bool = True
    ) -> tuple[StreamBatch | None, dict[str, float]]:
        """Collect a batch and train on it: the batch and its metrics."""
        cfg, started = self.config.learner, time.perf_counter()
        self._collecting.set()
        try:
            taken = self.stream.next_batch()
        finally:
            self._collecting.clear()
        if taken is None:  # the wait was abandoned: nothing of this step happened
            raise StopRequested(f"stopped after step {self.state.step}, waiting for data")
        batch, stream_metrics = taken
        past = self.state.past_rewards(batch)
        self.state.trained_on(batch)
        collected = time.perf_counter()
        train = TrainBatch.from_groups(batch.groups, self.state.version, past)
        prior = self.config.algorithm.critic_prior  # weighted value integration
        if prior is not None and train_policy:
            self.models.value_prior.weight = prior.weight(
                self.state.step, cfg.total_steps, self.state.value_reliability
            )
        mini_batches = make_mini_batches(
            train,
            cfg.mini_batch_groups,
            cfg.micro_batch_tokens,
            overlong_filter=self.config.algorithm.overlong.filter,
            shared_prompt=self.shared_prompt,
        )
        metrics = train_on_batch(
            self.models,
            train,
            mini_batches,
            self.config.algorithm,
            self.settings,
            self.topology,
            train_policy=train_policy,
        )
        done = time.perf_counter()
        if prior is not None:
            self.state.value_reliability = prior.reliability(
                self.state.value_reliability, metrics["critic/explained_var"]
            )
            metrics["critic/reliability"] = self.state.value_reliability
            if train_policy:
                metrics["critic/prior_weight"] = self.models.value_prior.weight
        tokens = sum(m.num_loss_tokens for m in mini_batches)
        metrics.update(batch.metrics() | stream_metrics)
        metrics.update(
            {
                "perf/step_s": done - started,
                "perf/wait_s": collected - started,  # waiting for B accepted groups
                "perf/learner_tokens_per_s": tokens / max(done - collected, 1e-9),
            }
        )
        return batch, metrics

    def train_step(self) -> dict[str, Any]:
        """Collect a batch, update, then publish / checkpoint / log as scheduled."""
        cfg, state = self.config.learner, self.state
        batch, metrics = self._train_batch()
        state.step += 1
        self.topology.main_only(lambda: self.heart.beat(f"step {state.step}"))
        self._check_health(metrics)
        self._check_skipped_updates(metrics)
        self._guard()
        if state.step % cfg.publish_every == 0:
            metrics.update(self.publisher.publish(self.models.policy.model, state.version + 1))
            state.version += 1
        if state.step % cfg.checkpoint_every == 0 or state.step == cfg.total_steps:
            self._checkpoint()
        if batch is not None:  # a stream batch: the learner's progress through the stream
            self.stream.write_progress(batch)
        cpu_s, cpu_util = self.cpu.lap()
        metrics.update({"step": state.step, "policy_version": state.version,
                        "perf/learner_cpu_s": cpu_s,
                        "perf/learner_cpu_util": cpu_util})  # fmt: skip
        self.reporter.log(metrics)
        if batch is not None:
            self.samples.log(batch, state.step)
        return metrics

    def _check_health(self, metrics: dict[str, Any]) -> None:
        """Rank 0: log each health condition this step set off, and record them as
        `metrics["health"]` (a list of `HealthEvent.as_record()`; absent when none)."""
        if self.health is None:
            return
        events = self.health.check({**metrics, "step": self.state.step})
        for event in events:
            log.warning(event.message)
        if events:
            metrics["health"] = [event.as_record() for event in events]

    def _check_skipped_updates(self, metrics: dict[str, float]) -> None:
        """Warn about skipped updates; fail once `max_skipped_updates` came in a row."""
        limit, step = self.config.learner.max_skipped_updates, self.state.step
        for name, part in self.models.trainables().items():
            skipped = int(metrics.get(f"{name}/skipped_updates", 0))
            if not skipped:
                continue
            log.warning(
                "step %d: skipped %d %s update(s): the gradient norm is %s (%d in a row, %d in "
                "all; the learner stops at %d in a row)",
                step, skipped, name, metrics[f"{name}/grad_norm"], part.skipped_in_a_row,
                part.skipped_total, limit,
            )  # fmt: skip
            if part.skipped_in_a_row >= limit:
                metrics.update({"step": step, "policy_version": self.state.version})
                self.reporter.log(metrics)
                raise DivergedError(
                    f"step {step}: the last {part.skipped_in_a_row} {name} optimiser "
                    "updates all had a non-finite gradient norm (NaN/inf), so none was applied "
                    f"(learner.max_skipped_updates={limit}). Training has diverged or the data "
                    "holds extreme values: lower learner.lr (and keep learner.grad_clip set), "
                    "check the rewards in the stream, then resume from the last checkpoint "
                    "(nothing diverged was published or checkpointed)"
                )

    def _checkpoint(self) -> None:
        # A checkpoint at version v implies v is committed: flush raises if it was not.
        started = time.monotonic()
        self.publisher.flush()
        self._guard()
        self.checkpoints.save(self.state)
        self.last_checkpoint_s = time.monotonic() - started
