"""The learner's checkpoints: what one holds, restoring from one, and what a new one lets go.

A checkpoint (`storage.checkpoints.dcp`) holds the models that learn with their optimisers (the
policy; a critic), the models that follow them (an EMA reference policy, as a frozen one is
rebuilt from the model path; the frozen pre-trained critic of weighted value integration), each
rank's RNG states, and the learner state record (`LearnerState`): the `TrainingState` (step,
policy version, stream cursor, filter totals, whether the critic was pre-trained, the prompts'
earlier rewards for temporal groups, the critic's reliability for weighted value integration),
the skipped-update counts, and the layout of the models (what decides the shapes of the saved
state: it must match to resume). `LearnerCheckpoints` writes that record and reads it back
(`_record` and `_restored`, side by side). The newest checkpoint that passes its checks is
restored (`CheckpointStore.latest_verified`); one written for other models is refused before
anything is loaded or written. After each save, older checkpoints beyond `keep_checkpoints` are
deleted and, with `stream_retention=consumed`, the stream segments no kept checkpoint can resume
before.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

from storage.checkpoints.dcp import CheckpointStore, LearnerState, ModelState, step_dirname
from storage.control.fencing import Fence
from storage.fs import Location, StorageError
from storage.stream.records import Cursor
from storage.stream.retention import oldest_resume_cursor, release_consumed
from streamrl.config.run import RunConfig
from streamrl.learner.batching import FilterCounts, StreamBatch
from streamrl.learner.lora import CHECKPOINT_OPTIONS
from streamrl.learner.reward_history import PastRewards, RewardHistory
from streamrl.learner.step_inputs import StepModels
from streamrl.learner.topology import Topology
from streamrl.models.lora import is_adapter_name

__all__ = ["IncompatibleCheckpointError", "LearnerCheckpoints", "TrainingState"]

log = logging.getLogger(__name__)


class IncompatibleCheckpointError(ValueError):
    """A checkpoint whose models this learner cannot load; the message lists the differences."""


@dataclass
class TrainingState:
    """Where the learner stands, besides its models: what a checkpoint records and a restore
    gives back. `version` is the newest policy version published (a checkpoint is written only
    once it is committed); `cursor` and `totals` are the stream position and filter totals after
    the last batch trained on; `value_pretrained` is false only before VAPO's critic
    pre-training; `rewards`, the prompts' earlier rewards when the algorithm pools them
    (temporal groups); `value_reliability`, rel_t of weighted value integration (the EMA of
    the critic's explained variance); `sft_position`, the examples a supervised or preference run
    took so far (conversations, `streamrl.learner.supervised`; pairs,
    `streamrl.learner.preference`). The loop advances it; the stream source reads `step`
    and `version` live."""

    step: int = 0
    version: int = 0
    cursor: Cursor = field(default_factory=Cursor)
    totals: FilterCounts = field(default_factory=FilterCounts)
    value_pretrained: bool = True
    rewards: RewardHistory | None = None
    value_reliability: float = 0.0
    sft_position: int = 0

    def past_rewards(self, batch: StreamBatch) -> PastRewards | None:
        """The earlier rewards of `batch`'s prompts (before `trained_on(batch)`), when kept."""
        return None if self.rewards is None else self.rewards.past(batch.groups, self.version)

    def trained_on(self, batch: StreamBatch) -> None:
        """Move the stream position past `batch`; remember its rewards when they are kept."""
        self.cursor, self.totals = batch.cursor_after, batch.totals
        if self.rewards is not None:
            self.rewards.record(batch.groups, self.version)


def _reliability(value: object) -> float:
    """rel_t as a checkpoint recorded it, checked: a number in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise ValueError(
            f"the checkpoint's value_reliability is {value!r}; expected a number in [0, 1]"
        )
    return float(value)


def _position(value: object) -> int:
    """sft_position as a checkpoint recorded it, checked: a count ≥ 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"the checkpoint's sft_position is {value!r}; expected a count ≥ 0")
    return value


class LearnerCheckpoints:
    """Saving and restoring one learner: its models and its `TrainingState` (see the module
    docstring). Every method is a collective: every rank calls it."""

    def __init__(
        self,
        config: RunConfig,
        run: Location,
        topology: Topology,
        models: StepModels,
        fence: Fence | None,
    ) -> None:
        self.config, self.run, self.topology, self.models = config, run, topology, models
        self.store, self.fence = CheckpointStore(run, fence=fence), fence
        self.last_saved_step: int | None = None  # the step of the checkpoint restored or saved

    def restore(self) -> TrainingState:
        """Load the newest verified checkpoint into the models (and each rank's RNG states) and
        return the state it recorded; a fresh state at step 0 for a run without one."""
        latest = self.store.latest_verified()
        if latest is None:
            supervised = self.config.learner_only is not None  # no critic to pre-train
            return TrainingState(
                value_pretrained=supervised or not self.config.algorithm.uses_value_model,
                rewards=self._reward_history(None),
            )
        self._check_compatible(self.store.read_state(latest), latest)
        state = self._restored(self.store.load(latest, self._app_state()))
        self.last_saved_step = state.step
        log.info(
            "resumed at step %d, version %d, stream %s", state.step, state.version, state.cursor
        )
        return state

    def save(self, state: TrainingState) -> None:
        """Checkpoint the models and `state` (its `version`: committed), then retain."""
        self.store.save(self._app_state(), self._record(state))
        self.last_saved_step = state.step
        self.store.retain(self.config.learner.keep_checkpoints)
        if self.config.storage.stream_retention == "consumed":
            self._release_consumed()

    def _record(self, state: TrainingState) -> LearnerState:
        """The learner state record of a checkpoint; `_restored` reads it back."""
        return LearnerState(
            step=state.step,
            policy_version=state.version,
            stream_cursor=state.cursor.to_dict(),
            extra={
                "filter_totals": asdict(state.totals),
                "value_pretrained": state.value_pretrained,
                "skipped_updates": {
                    name: [part.skipped_in_a_row, part.skipped_total]
                    for name, part in self.models.trainables().items()
                },
                "layout": self._layout(),
                "reward_history": state.rewards and state.rewards.to_record(),
                "value_reliability": state.value_reliability,
                "sft_position": state.sft_position,
            },
        )

    def _restored(self, record: LearnerState) -> TrainingState:
        """What `_record` wrote: the skipped-update counts go back into the models (a key that
        older checkpoints lack takes its default)."""
        for name, (in_a_row, total) in record.extra.get("skipped_updates", {}).items():
            part = self.models.trainables()[name]
            part.skipped_in_a_row, part.skipped_total = in_a_row, total
        return TrainingState(
            step=record.step,
            version=record.policy_version,
            cursor=Cursor.from_dict(record.stream_cursor),
            totals=FilterCounts(**record.extra.get("filter_totals", {})),
            value_pretrained=record.extra.get("value_pretrained", True),
            rewards=self._reward_history(record.extra.get("reward_history")),
            value_reliability=_reliability(record.extra.get("value_reliability", 0.0)),
            sft_position=_position(record.extra.get("sft_position", 0)),
        )

    def _reward_history(self, record: object) -> RewardHistory | None:
        """The temporal groups' state: from a checkpoint's `record` (None: empty), when the
        algorithm keeps one."""
        kept = self.config.algorithm.reward_history
        if kept is None or self.config.learner_only is not None:
            return None
        if record is None:
            return RewardHistory(*kept)
        return RewardHistory.from_record(record, *kept)

    def _release_consumed(self) -> None:
        try:  # on every rank: reading the checkpoints' cursors is a collective
            oldest = oldest_resume_cursor(self.store)
            released = self.topology.main_only(
                lambda: release_consumed(self.run, oldest, fence=self.fence)
            )
        except (OSError, StorageError) as exc:  # the next checkpoint releases them
            log.warning("could not release consumed stream segments: %r", exc)
            return
        if released:
            log.info(
                "released %d consumed stream segments (log numbers below %d)",
                len(released), oldest.seq,
            )  # fmt: skip

    def _app_state(self) -> dict[str, ModelState]:
        models = self.models
        # A LoRA policy's checkpoint holds its adapters: the frozen base comes from model.path.
        lora = self.config.model.lora is not None
        options, keep = (CHECKPOINT_OPTIONS, is_adapter_name) if lora else (None, None)
        state = {"policy": ModelState(models.policy.model, models.policy.optimizer, options, keep)}
        if models.critic is not None:
            state["critic"] = ModelState(models.critic.model, models.critic.optimizer)
        kl = self.config.algorithm.reference_kl
        if (
            models.reference is not None and kl is not None and kl.reference == "ema"
        ):  # a frozen one is reloaded
            state["reference"] = ModelState(models.reference)
        if models.value_prior is not None:  # V_pre, the critic as its pre-training left it
            state["value_prior"] = ModelState(models.value_prior.model)
        return state

    def _layout(self) -> dict[str, object]:
        """What decides the shapes of the checkpointed state: it must match to resume."""
        model = self.models.policy.model.config
        kl = self.config.algorithm.reference_kl if self.models.reference is not None else None
        return {
            "architecture": (model.architectures or [type(self.models.policy.model).__name__])[0],
            "vocab_size": model.vocab_size,
            "hidden_size": model.hidden_size,
            "num_hidden_layers": model.num_hidden_layers,
            "critic": self.models.critic is not None,
            "value_head": (
                self.config.algorithm.value_head.layout if self.models.critic is not None else None
            ),
            "reference": None if kl is None else kl.reference,
            "lora": self._lora_layout(),
            "checkpointed_models": sorted(self._app_state()),
        }

    def _lora_layout(self) -> dict[str, object] | None:
        lora = self.config.model.lora
        return None if lora is None else lora.model_dump(mode="json")

    def _check_compatible(self, state: LearnerState, step: int) -> None:
        saved = state.extra.get("layout")
        if saved is None:
            return  # written before layouts were recorded: DCP itself checks names and shapes
        mine = self._layout()
        differences = [
            f"{key}: checkpoint {saved.get(key)!r}, this learner {mine[key]!r}"
            for key in mine
            if saved.get(key) != mine[key]
        ]
        if differences:
            where = self.store.location.child(step_dirname(step)).uri
            raise IncompatibleCheckpointError(
                f"checkpoint {where} was written for other models ({'; '.join(differences)}). "
                "Nothing was loaded or written. Resume it with the configuration it was "
                "written with, or start a new run (another storage.run_uri)"
            )
