"""Runs built on local disk with the project's own writers, for the audit and health tests: a
generator's stream (`StreamWriter`), and a learner life that reads it with the `StreamReader`
and chooses batches with the `BatchCollector` as the learner does, then publishes weight
versions (`WeightWriter`, deltas against the previous version), saves checkpoints
(`CheckpointStore`, with the learner state record's stream cursor and filter totals) and logs
each step's metrics (`MetricsReporter`) — everything but the model, which a tiny tensor stands
for."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from torch import nn

from storage.checkpoints.dcp import CheckpointStore, LearnerState, ModelState
from storage.control.manifest import create_run
from storage.fs import Location, open_location
from storage.stream.records import Cursor, ScoredGroup
from storage.stream.writer import StreamReader, StreamWriter
from storage.weights.publish import WeightWriter
from storage.weights.versions import WeightStore
from streamrl.config.loading import load_config
from streamrl.config.run import RunConfig
from streamrl.learner.batching import BatchCollector, FilterCounts
from streamrl.learner.config import LoggingConfig
from streamrl.learner.reporting import MetricsReporter
from tests.stream_data import random_group

VOCAB = 600
BATCH_GROUPS = 2
SEGMENT_GROUPS = 3


def new_run(root: Path, *overrides: str) -> tuple[Location, RunConfig]:
    """A DAPO run (dynamic sampling on) of batches of BATCH_GROUPS groups at `root`."""
    config = load_config(
        ["dapo", "tiny-cpu"],
        overrides=[
            f"storage.run_uri={root}",
            f"learner.batch_groups={BATCH_GROUPS}",
            f"learner.mini_batch_groups={BATCH_GROUPS}",
            "learner.max_staleness=1",
            *overrides,
        ],
    )
    run = open_location(str(root))
    create_run(run, config.model_dump(mode="json"))
    return run, config


def group(i: int, version: int, scores: list[float]) -> ScoredGroup:
    """Group `i`, sampled at `version`, its responses scored `scores` (1 correct, 0 wrong)."""
    made = random_group(
        np.random.default_rng(i), prompt_id=f"p{i}", group_size=len(scores), vocab=VOCAB,
        max_len=12, prompt_len=6, policy_version=version,
    )  # fmt: skip
    raw = np.asarray(scores, np.float32)
    return ScoredGroup(**{**made.__dict__, "raw_scores": raw, "rewards": 2 * raw - 1})


def write_stream(run: Location, groups: int, writer: str = "gen0") -> None:
    """`groups` groups in segments of SEGMENT_GROUPS: each fourth one without signal (every
    response correct), the others mixed; group i sampled at version i // 5, so a learner that
    outpaces the stream drops stale groups too."""
    made = [
        group(i, i // 5, [1.0, 1.0, 1.0, 1.0] if i % 4 == 3 else [1.0, 0.0, 0.0, 1.0])
        for i in range(groups)
    ]
    stream = StreamWriter(run, writer)
    for start in range(0, groups, SEGMENT_GROUPS):
        stream.write(made[start : start + SEGMENT_GROUPS])


def weights_of(version: int) -> dict[str, torch.Tensor]:
    """The "model" at `version`: one element changes per version, so versions are deltas."""
    tensor = torch.arange(64, dtype=torch.float32)
    tensor[0] = float(version)
    return {"w": tensor}


def train(
    run: Location, config: RunConfig, steps_to: int, *, checkpoint_every: int = 2,
    crash: bool = False,
) -> BatchCollector:  # fmt: skip
    """One learner life, from the newest checkpoint to step `steps_to` (module docstring);
    a weight version per step, not published again when an earlier life did. `crash`: the life
    dies right after logging step `steps_to`, with no checkpoint of it off the schedule."""
    store, state = CheckpointStore(run), None
    if (latest := store.latest_committed()) is not None:
        state = store.read_state(latest)
    step, version = (state.step, state.policy_version) if state else (0, 0)
    cursor = Cursor.from_dict(state.stream_cursor) if state else Cursor()
    totals = FilterCounts(**state.extra["filter_totals"]) if state else FilterCounts()
    reader = StreamReader(run, cursor, prefetch_rounds=0, max_poll_s=0.05)
    collector = BatchCollector(
        batch_groups=config.learner.batch_groups, max_staleness=config.learner.max_staleness,
        dynamic_sampling=config.algorithm.dynamic_sampling, vocab_size=VOCAB, max_seq_len=64,
        totals=totals,
    )  # fmt: skip
    groups = reader.groups(timeout_s=2.0)
    logging = LoggingConfig(wandb_mode="disabled")
    with MetricsReporter(run, logging, config={}, total_steps=steps_to, start_step=step) as out:
        while step < steps_to:
            batch = collector.collect(groups, lambda: reader.cursor, version)
            step, version = step + 1, version + 1
            if version not in WeightStore(run).versions():
                base = (version - 1, weights_of(version - 1)) if version > 1 else None
                WeightWriter(run).publish(version, weights_of(version), base=base)
            if step % checkpoint_every == 0 or (step == steps_to and not crash):
                learner = LearnerState(
                    step, version, batch.cursor_after.to_dict(),
                    extra={"filter_totals": asdict(batch.totals)},
                )  # fmt: skip
                store.save({"policy": ModelState(nn.Linear(2, 2))}, learner)
            out.log({**batch.metrics(), "step": step, "policy_version": version})
    groups.close()
    return collector
