"""Training-health conditions, checked on the learner's metrics after every step.

The monitoring targets practitioners watch, each a named condition (the name is stable: the
flow emits it as the Prefect event `streamrl.health.<name>`), its metric, its rule and the
config field that sets it:

    entropy-collapse    actor/entropy            below health.entropy_collapse_ratio × its
                                                 baseline (the mean of the first
                                                 health.baseline_steps steps), or below
                                                 health.entropy_min nats
    kl-high             actor/ref_kl             above health.kl_max (logged only with a
                                                 reference model: algorithm.kl)
    grad-norm-spike     actor/grad_norm          above health.grad_norm_spike × the median of
                                                 the previous health.grad_norm_window finite
                                                 norms (once 5 are known, median > 0)
    length-runaway      rollout/response_len_mean  at or above health.length_frac ×
                                                 generator.max_tokens
    non-finite-update   actor/skipped_updates    above 0: an update had a NaN/inf gradient norm
                                                 (learner.max_skipped_updates in a row stop
                                                 the learner)
    waste-high          stream/waste_frac        above health.waste_max
    staleness-at-bound  stream/staleness_max     at or above learner.max_staleness (when > 0)
    mismatch-high       mismatch/kl_k3_fresh     above health.mismatch_kl_max: the generator's
                                                 and the learner's log-probs disagree on fresh
                                                 groups (engine mismatch, not staleness)
    tools-unused        rollout/tool_calls_mean  0 for health.tools_unused_steps steps in a row
                                                 while the environment offers tools
                                                 (rollout/tools_offered_frac > 0)

Edge-triggered: a condition fires on the step it becomes true and not again until a step
where it was evaluated and false. A step without the metric, or with a non-finite value,
does not evaluate the condition and leaves its state as it was (a non-finite gradient norm is
non-finite-update's business). `HealthMonitor` is pure: the learner logs each event as one
warning and records it in the step's metrics (`"health": [HealthEvent.as_record(), ...]`).
"""

from __future__ import annotations

import math
import statistics
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from streamrl.learner.config import HealthConfig

__all__ = ["CONDITIONS", "HealthEvent", "HealthMonitor"]

CONDITIONS = (
    "entropy-collapse",
    "kl-high",
    "grad-norm-spike",
    "length-runaway",
    "non-finite-update",
    "waste-high",
    "staleness-at-bound",
    "mismatch-high",
    "tools-unused",
)
"""Every condition's name, in the order they are checked."""

MIN_GRAD_NORM_HISTORY = 5
"""Previous finite gradient norms grad-norm-spike needs before it is checked."""


@dataclass(frozen=True)
class HealthEvent:
    """A condition that became true at `step`: the metric's `value`, the `threshold` it
    crossed, and `message`, one sentence naming the metric, both numbers and the config field
    that sets the threshold. Its record (`as_record`) is a JSON object with exactly these five
    keys: condition (str, one of `CONDITIONS`), step (int), value, threshold (float), message.
    """

    condition: str
    step: int
    value: float
    threshold: float
    message: str

    def as_record(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> HealthEvent:
        return cls(
            condition=str(record["condition"]),
            step=int(record["step"]),
            value=float(record["value"]),
            threshold=float(record["threshold"]),
            message=str(record["message"]),
        )


@dataclass(frozen=True)
class _Verdict:
    """A condition evaluated on one value: whether it holds, its threshold, how the value
    relates to it when it holds ("above"), and the message's explanation of the threshold and
    what it means."""

    holds: bool
    threshold: float
    relation: str
    why: str


class _Condition(ABC):
    """One condition on one metric. `judge` evaluates a finite value and remembers what the
    condition needs of it (a baseline, a window); None: not evaluable yet."""

    name: str
    metric: str
    only_with: str | None = None  # a metric that must be > 0 for the condition to apply

    @abstractmethod
    def judge(self, value: float) -> _Verdict | None: ...


@dataclass
class _Fixed(_Condition):
    """value > threshold (or ≥ with `inclusive`); `source` names the threshold's config."""

    name: str
    metric: str
    threshold: float
    source: str
    meaning: str
    inclusive: bool = False

    def judge(self, value: float) -> _Verdict:
        holds = value >= self.threshold if self.inclusive else value > self.threshold
        relation = "at or above" if self.inclusive else "above"
        return _Verdict(holds, self.threshold, relation, f"{self.source}; {self.meaning}")


@dataclass
class _EntropyCollapse(_Condition):
    """Below ratio × baseline (once the baseline's steps are in) or below `minimum`."""

    ratio: float
    minimum: float
    baseline_steps: int
    name: str = "entropy-collapse"
    metric: str = "actor/entropy"

    def __post_init__(self) -> None:
        self._first: list[float] = []

    def judge(self, value: float) -> _Verdict:
        threshold, why = self.minimum, "health.entropy_min"
        if len(self._first) < self.baseline_steps:  # a step of the baseline: minimum only
            self._first.append(value)
        elif self.ratio * (baseline := statistics.fmean(self._first)) > self.minimum:
            threshold = self.ratio * baseline
            why = (
                f"health.entropy_collapse_ratio={self.ratio:g} × the baseline {baseline:.4g}, "
                f"the mean of the first {self.baseline_steps} steps"
            )
        why += "; the policy is losing its exploration"
        return _Verdict(value < threshold, threshold, "below", why)


@dataclass
class _GradNormSpike(_Condition):
    """Above factor × the median of the previous `window` norms (≥ MIN_GRAD_NORM_HISTORY)."""

    factor: float
    window: int
    name: str = "grad-norm-spike"
    metric: str = "actor/grad_norm"

    def __post_init__(self) -> None:
        self._previous: deque[float] = deque(maxlen=self.window)

    def judge(self, value: float) -> _Verdict | None:
        known = len(self._previous)
        median = statistics.median(self._previous) if known else 0.0
        self._previous.append(value)
        if known < MIN_GRAD_NORM_HISTORY or median <= 0:
            return None
        threshold = self.factor * median
        why = (
            f"health.grad_norm_spike={self.factor:g} × {median:.4g}, the median of the "
            f"previous {known} steps; one batch pushed far harder than usual"
        )
        return _Verdict(value > threshold, threshold, "above", why)


@dataclass
class _ToolsUnused(_Condition):
    """No tool call for `steps` steps in a row, on steps whose environment offered tools."""

    steps: int
    name: str = "tools-unused"
    metric: str = "rollout/tool_calls_mean"
    only_with: str | None = "rollout/tools_offered_frac"

    def __post_init__(self) -> None:
        self._run = 0  # steps in a row without a call

    def judge(self, value: float) -> _Verdict:
        self._run = self._run + 1 if value <= 0 else 0
        why = (
            f"no tool call for {self._run} steps in a row (health.tools_unused_steps="
            f"{self.steps}); the model never calls its tools, so there is no tool use to "
            "reinforce: warm-start it on demonstrations (streamrl sft) or show a worked call "
            "in the prompt"
        )
        return _Verdict(self._run >= self.steps, 0.0, "at", why)


class HealthMonitor:
    """The conditions of one learner (see the module docstring); rank 0 keeps one.

    `max_tokens`: generator.max_tokens; `max_staleness`: learner.max_staleness (0 turns
    staleness-at-bound off: on-policy, every group is at the bound)."""

    def __init__(self, config: HealthConfig, *, max_tokens: int, max_staleness: int) -> None:
        self.enabled = config.enabled
        limit = config.length_frac * max_tokens
        conditions: list[_Condition] = [
            _EntropyCollapse(config.entropy_collapse_ratio, config.entropy_min,
                             config.baseline_steps),
            _Fixed("kl-high", "actor/ref_kl", config.kl_max, "health.kl_max",
                   "the policy has drifted far from its reference"),
            _GradNormSpike(config.grad_norm_spike, config.grad_norm_window),
            _Fixed("length-runaway", "rollout/response_len_mean", limit,
                   f"health.length_frac={config.length_frac:g} × generator.max_tokens="
                   f"{max_tokens}", "responses are running into the length limit",
                   inclusive=True),
            _Fixed("non-finite-update", "actor/skipped_updates", 0.0,
                   "an update's gradient norm was NaN/inf and it was skipped",
                   "learner.max_skipped_updates in a row stop the learner: lower learner.lr "
                   "or keep learner.grad_clip set"),
            _Fixed("waste-high", "stream/waste_frac", config.waste_max, "health.waste_max",
                   "most generated groups are not trained on: stale, or without signal"),
        ]  # fmt: skip
        if max_staleness > 0:
            conditions.append(
                _Fixed("staleness-at-bound", "stream/staleness_max", float(max_staleness),
                       "learner.max_staleness", "groups arrive as stale as the learner "
                       "accepts; any further behind are dropped", inclusive=True)
            )  # fmt: skip
        conditions.append(
            _Fixed("mismatch-high", "mismatch/kl_k3_fresh", config.mismatch_kl_max,
                   "health.mismatch_kl_max", "the generator and the learner disagree on "
                   "fresh groups' log-probs: check sampling settings, dtype and weight sync")
        )  # fmt: skip
        conditions.append(_ToolsUnused(config.tools_unused_steps))
        self._conditions = conditions
        self._active: set[str] = set()

    def seed(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Feed a resumed learner's earlier step records, in step order (value pre-training
        records are skipped): baselines, windows and which conditions hold carry on, and
        nothing is emitted (a condition that held at the last record fires only after it
        has cleared)."""
        for record in records:
            if "value_pretrain_step" not in record:
                self._evaluate(record)

    def check(self, metrics: Mapping[str, Any]) -> list[HealthEvent]:
        """The events of one step's metrics (with its `step`): the conditions that became
        true on it."""
        return self._evaluate(metrics)

    def _evaluate(self, metrics: Mapping[str, Any]) -> list[HealthEvent]:
        if not self.enabled:
            return []
        step, events = int(metrics.get("step", 0)), []
        for condition in self._conditions:
            value = metrics.get(condition.metric)
            if not isinstance(value, int | float) or not math.isfinite(value):
                continue
            if condition.only_with is not None and not metrics.get(condition.only_with, 0) > 0:
                continue
            verdict = condition.judge(float(value))
            if verdict is None:
                continue
            if not verdict.holds:
                self._active.discard(condition.name)
            elif condition.name not in self._active:
                self._active.add(condition.name)
                events.append(_event(condition, step, float(value), verdict))
        return events


def _event(condition: _Condition, step: int, value: float, verdict: _Verdict) -> HealthEvent:
    message = (
        f"health: {condition.name} at step {step}: {condition.metric} = {value:.4g} is "
        f"{verdict.relation} {verdict.threshold:.4g} ({verdict.why})"
    )
    return HealthEvent(condition.name, step, value, verdict.threshold, message)
