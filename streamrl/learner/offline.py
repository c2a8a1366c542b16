"""The learner on a dataset instead of the stream: the loop a supervised and a preference run
share (`streamrl.learner.supervised`, `streamrl.learner.preference`).

`OfflineLearner` is `Learner` with its data source replaced: a subclass reads its dataset once
(`load_examples`, given the model's tokenizer) and trains a step on `learner.batch_groups`
examples taken in order from `TrainingState.sft_position` (checkpointed, so a resumed run takes
the same examples next), packed into the learner's mini- and micro-batches (`step`, given them
and the step's groups); every
`eval_every` steps and at the last it adds its held-out metrics (`heldout`), and to the first
step of a run those of the weights it started from, each key under `initial/` (measured before
the step trains: what the stage changed is read from one run's metrics). Metrics of its own:
`<prefix>/tokens`, `<prefix>/<examples>`, `<prefix>/epoch`, `perf/step_s`,
`perf/learner_tokens_per_s`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any, Protocol

from storage.stream.records import ScoredGroup
from streamrl.learner.loop import Learner
from streamrl.learner.metrics_records import INITIAL
from streamrl.learner.mini_batches import MiniBatch, TrainBatch, make_mini_batches

__all__ = ["Examples", "OfflineLearner"]


class Examples(Protocol):
    """A dataset as the loop takes it: `batch` of examples as groups, the held-out ones."""

    def __len__(self) -> int: ...

    def batch(self, position: int, size: int, version: int) -> list[ScoredGroup]: ...

    def heldout_groups(self, version: int) -> list[ScoredGroup]: ...


class OfflineLearner(Learner, ABC):
    """`Learner` on a dataset (module docstring). Subclasses set `prefix` (metric prefix),
    `examples_name` and `whole_groups` (a group's responses in one micro-batch), and give
    `load_examples`, `eval_every`, `step` and `heldout`."""

    prefix = ""
    examples_name = "examples"
    whole_groups = False

    @abstractmethod
    def load_examples(self, tokenizer: Any) -> Examples:
        """The dataset, read once at start with the model's tokenizer."""

    @property
    @abstractmethod
    def eval_every(self) -> int:
        """Held-out metrics every this many steps and at the last (0: never)."""

    @abstractmethod
    def step(self, mini_batches: list[MiniBatch], groups: list[ScoredGroup]) -> dict[str, float]:
        """Train on the step's mini-batches (of `groups`); the step's metrics."""

    @abstractmethod
    def heldout(self, groups: list[ScoredGroup]) -> dict[str, float]:
        """The held-out metrics of `groups`."""

    def _data_source(self) -> None:
        from transformers import AutoTokenizer

        from streamrl.models import resolve_model_path

        model = self.config.model
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model.tokenizer or model.path))
        self.examples = self.load_examples(tokenizer)
        return None

    def _train_batch(self, *, train_policy: bool = True) -> tuple[None, dict[str, float]]:
        cfg, state = self.config.learner, self.state
        initial: dict[str, float] = {}
        first = self.eval_every and state.step == 0  # the weights it started from, untrained
        if first and (heldout := self.examples.heldout_groups(state.version)):
            initial = {f"{INITIAL}{k}": v for k, v in self.heldout(heldout).items()}
        started = time.perf_counter()
        groups = self.examples.batch(state.sft_position, cfg.batch_groups, state.version)
        state.sft_position += len(groups)
        batch = TrainBatch.from_groups(groups, state.version)
        mini_batches = make_mini_batches(
            batch, cfg.mini_batch_groups, cfg.micro_batch_tokens,
            shared_prompt=self.shared_prompt, whole_groups=self.whole_groups,
        )  # fmt: skip
        metrics = self.step(mini_batches, groups)
        done = time.perf_counter()
        tokens = sum(m.num_loss_tokens for m in mini_batches)
        step = state.step + 1
        if self.eval_every and (step % self.eval_every == 0 or step == cfg.total_steps):
            heldout = self.examples.heldout_groups(state.version)
            if heldout:
                metrics.update(self.heldout(heldout))
        metrics.update(initial)
        metrics.update({
            f"{self.prefix}/tokens": float(tokens),
            f"{self.prefix}/{self.examples_name}": float(len(groups)),
            f"{self.prefix}/epoch": state.sft_position / len(self.examples),
            "perf/step_s": time.perf_counter() - started,
            "perf/learner_tokens_per_s": tokens / max(done - started, 1e-9),
        })  # fmt: skip
        return None, metrics
