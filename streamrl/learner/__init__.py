"""The learner: consumes the replay stream, trains the policy with FSDP2, publishes weights and
checkpoints through `storage/`.

- `batching`: which stream groups form a batch (staleness, dynamic sampling); `mini_batches`:
  the batch as tensors → token-budget micro-batches, whose forward rows (`packing`) compute
  each group's prompt once.
- `topology`, `model`, `optim`: the process group, FSDP2-sharded models, AdamW and schedules.
- `forward`: the models' forward passes, the LM head only where a loss needs it.
- `step`: one optimiser update per mini-batch — `scoring` (advantages and what the losses
  compare against), `objective` (the losses), `step_metrics` (their reduction over ranks),
  `step_inputs` (models, settings).
- `reporting`: each step's metrics to the run's JSONL, wandb and a console progress bar.
- `samples`: stream groups decoded into what the model wrote (`streamrl samples`);
  `sample_table`: a few of each logged step's responses as a wandb table.
- `stream_source`: rank 0 reads the stream, chooses each batch, records the learner's progress.
- `checkpointing`: saves and restores the models and the learner's `TrainingState`.
- `loop`: `Learner`, the loop that ties them to the stream, the weight store and checkpoints.
- `supervised`: `SupervisedLearner`, the same loop on chat conversations (a run with `sft`);
  `preference`: `PreferenceLearner`, on preference pairs (a run with `preference`).

`run_learner` is what `streamrl learner --run RUN_URI` runs on every rank of a torchrun job.

Imports: `storage`, `streamrl.config`, `streamrl.placement` and the packages beneath them
(`algorithms`, `models`, `isolation`); nothing of the generator, supervision, runs or the command
line.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_learner"]


def run_learner(
    run_uri: str, *, storage_options: dict[str, Any] | None = None, take_over: bool = False
) -> int:
    """Train an existing run to its step budget (resuming from its latest checkpoint); the
    number of steps done. Call it on every rank: torchrun's environment sets the topology.
    `take_over`: take the run's lease even from a learner that still holds it (a supervisor
    that saw the previous learner end; `storage.control.lease`). With `learner.checkpoint_on_stop`,
    SIGTERM or Ctrl-C (from the main thread) stops it with a checkpoint: `StopRequested`."""
    import os
    import signal

    from streamrl.config.stored import open_existing_run
    from streamrl.isolation.lifetime import die_with_parent, stop_on_sigterm
    from streamrl.learner.loop import Learner
    from streamrl.learner.preference import PreferenceLearner
    from streamrl.learner.supervised import SupervisedLearner
    from streamrl.learner.topology import Topology
    from streamrl.placement import bind_rank

    # A learner of several ranks placed on cores: each rank on its own (threads = its share).
    bind_rank(int(os.environ.get("LOCAL_RANK", "0")))
    config, run = open_existing_run(run_uri, storage_options)
    stop = stop_on_sigterm() if config.learner.checkpoint_on_stop else None
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank of torchrun's: stop (checkpointing) with it
        die_with_parent(os.getppid(), signal.SIGTERM)
    with Topology.from_env(config.learner.device) as topology:
        learner = {None: Learner, "supervised": SupervisedLearner,
                   "preference": PreferenceLearner}[config.learner_only]  # fmt: skip
        return learner(config, run, topology, take_over=take_over, stop=stop).run()
