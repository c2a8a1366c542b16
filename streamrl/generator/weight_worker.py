"""The worker side of live weight updates: every vLLM worker reads the version it needs straight
from the run's weight store.

`WeightReloadExtension` is mixed into each vLLM worker (`worker_extension_cls`) and called by
name through `collective_rpc`, whether the worker runs in the generator's process (vLLM's CPU
default) or in processes of its own (an engine core process, tensor-parallel workers). Only small
plain values cross that RPC — a `WeightSource` as a dict, version numbers, an `Advance` as a
dict — so no state dict is ever serialised through the engine. Each worker keeps a
`WeightFollower` between calls: with deltas on (`weights.full_every` > 1) it holds the last
version built, in the published dtype on the worker's host, and applies the next version's
deltas to it; with full versions only it holds nothing between updates.

Two steps, so that reading and verifying (which may fail) happen before the engine pauses:
`prepare_streamrl_weights` builds a version and `apply_streamrl_weights` loads it in place
(`streamrl.generator.engine.Engine.advance_weights` runs the sequence).

An engine placed beside the learner (`WeightSource.handoff`) takes a committed version from the
learner's memory instead of reading it (`streamrl.placement.handoff`): `prepare` finds the
newest committed version in the store as always, then takes it from the hand-off when the
learner's slots hold that publish; `apply` loads it device to device and, if the slots changed
while it loaded (a torn load), loads the version from storage after all before the engine
resumes. Storage remains the fallback for anything the hand-off does not hold.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from storage.fs import Location, open_location
from storage.weights.follower import Advance, WeightFollower
from storage.weights.versions import WeightIntegrityError, WeightStore, WeightVersionNotFoundError
from streamrl.learner.config import WeightsConfig
from streamrl.placement.handoff import HANDOFF_VARIABLE, HandOffReader, Taken, handoff_dir

__all__ = ["WeightReloadExtension", "WeightSource", "advance_follower", "take_handed_off"]


@dataclass(frozen=True)
class WeightSource:
    """The weight store an engine's workers read from: a run root reopened in each worker.

    Plain data, sent as a dict through vLLM's RPC. `storage_options` are those the run was
    opened with (endpoint, fsspec options); credentials normally come from each worker's
    environment. `hold`: keep the last version between updates so deltas apply to it.
    `handoff`: take versions from the learner's memory when it holds them (this engine was
    placed beside the learner)."""

    run_uri: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    hold: bool = True
    handoff: bool = False

    @classmethod
    def of(cls, run: Location, weights: WeightsConfig) -> WeightSource:
        """The weight store of the run at `run`, as `weights` publishes it: holding is worth
        its memory only when deltas are published. The hand-off is used where the placement
        asked for it (`HANDOFF_VARIABLE` in this process's environment)."""
        handoff = os.environ.get(HANDOFF_VARIABLE) == "1"
        return cls(run.uri, run.storage_options(), hold=weights.full_every > 1, handoff=handoff)

    def open(self) -> WeightStore:
        return WeightStore(open_location(self.run_uri, storage_options=self.storage_options))

    def __repr__(self) -> str:  # never show storage options: they may hold credentials
        return f"WeightSource({self.run_uri!r}, hold={self.hold})"


class WeightReloadExtension:
    """Mixed into every vLLM worker: build a version from the weight store, load it in place."""

    _streamrl_source: WeightSource | None = None
    _streamrl_follower: WeightFollower | None = None
    _streamrl_handoff: HandOffReader | None = None
    _streamrl_taken: Taken | None = None

    def prepare_streamrl_weights(
        self,
        source: dict[str, Any],
        newer_than: int | None,
        skip: list[int],
        exactly: int | None,
    ) -> dict[str, Any]:
        """Build the newest intact version above `newer_than` not in `skip` (or `exactly` that
        one) and hold it for `apply_streamrl_weights`; the `Advance` as a dict.

        Nothing raises for a bad version: a corrupt or vanished one, even the one asked for
        `exactly`, is reported in the result, which crosses process boundaries as data."""
        wanted = WeightSource(**source)
        if self._streamrl_follower is None or wanted != self._streamrl_source:
            self._streamrl_follower = WeightFollower(wanted.open(), hold=wanted.hold)
            self._streamrl_source = wanted
            self._streamrl_handoff = (
                HandOffReader(handoff_dir(wanted.run_uri)) if wanted.handoff else None
            )
        self._streamrl_taken = None
        if self._streamrl_handoff is not None:
            self._streamrl_taken = take_handed_off(
                self._streamrl_handoff, self._streamrl_follower.store, newer_than, skip, exactly,
                self.device,  # type: ignore[attr-defined]
            )  # fmt: skip
            if self._streamrl_taken is not None:
                return asdict(Advance(self._streamrl_taken.version))
        return asdict(advance_follower(self._streamrl_follower, newer_than, skip, exactly))

    def apply_streamrl_weights(self) -> str:
        """Load the version `prepare_streamrl_weights` built in place, re-pack a tied lm_head,
        then drop the tensors unless the follower holds them for the next delta. Returns where
        the weights came from: `handoff` or `storage` (after a torn hand-off too)."""
        follower = self._streamrl_follower
        if follower is None:
            raise RuntimeError("apply_streamrl_weights before prepare_streamrl_weights")
        runner = self.model_runner  # type: ignore[attr-defined]
        taken, self._streamrl_taken = self._streamrl_taken, None
        if taken is not None:
            runner.reload_weights(weights_iterator=iter(taken.tensors().items()))
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if taken.intact():
                _repack_tied_lm_head(runner.get_model())
                return "handoff"
            # The learner overwrote the slot while it was read: load the version from storage
            # (the engine is paused; it resumes with whole weights or not at all).
            found = follower.advance(exactly=taken.version)
            assert found.version == taken.version
        # vLLM's loaders copy into the parameters (`copy_` casts: tensors published in another
        # dtype than the engine's load as they are) and keep no reference to them, so the held
        # tensors, which the next delta changes in place, never alias live weights (both
        # checked on vLLM 0.32's CPU backend).
        runner.reload_weights(weights_iterator=iter(follower.tensors().items()))
        _repack_tied_lm_head(runner.get_model())
        follower.release()
        return "storage"


def advance_follower(
    follower: WeightFollower, newer_than: int | None, skip: list[int], exactly: int | None
) -> Advance:
    """Build the newest intact version above `newer_than` not in `skip` (or `exactly` that
    one) in `follower`. Nothing raises for a bad version: a corrupt or vanished one, even the
    one asked for `exactly`, is reported in the `Advance`."""
    if exactly is None:
        return follower.advance(newer_than=newer_than, skip=skip)
    try:
        return follower.advance(exactly=exactly)
    except WeightIntegrityError as exc:
        return Advance(None, corrupt={exactly: str(exc)})
    except WeightVersionNotFoundError:
        return Advance(None, vanished=[exactly])


def take_handed_off(
    reader: HandOffReader,
    store: WeightStore,
    newer_than: int | None,
    skip: list[int],
    exactly: int | None,
    device: torch.device,
) -> Taken | None:
    """The version an engine would build from `store` (the newest committed above `newer_than`
    not in `skip`, or `exactly` that one), taken from the learner's hand-off; None when the
    hand-off does not hold it or its manifest cannot be read (storage then decides, and
    reports what it finds)."""
    if exactly is None:
        newer = [v for v in store.versions() if v > (newer_than or 0) and v not in skip]
        if not newer:
            return None
        exactly = max(newer)
    try:
        manifest = store.read_manifest(exactly)
    except (WeightIntegrityError, WeightVersionNotFoundError):
        return None
    return reader.take(manifest, device)


def _repack_tied_lm_head(model: torch.nn.Module) -> None:
    """vLLM's CPU backend keeps a packed copy of a tied lm_head for its GEMM: rebuild it from
    the embedding just loaded."""
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    tied = (
        lm_head is not None
        and embed is not None
        and lm_head.weight.data_ptr() == embed.weight.data_ptr()
    )
    method = getattr(lm_head, "quant_method", None)
    if tied and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(lm_head)
