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
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from storage.fs import Location, open_location
from storage.weights.follower import Advance, WeightFollower
from storage.weights.versions import WeightIntegrityError, WeightStore, WeightVersionNotFoundError
from streamrl.learner.config import WeightsConfig

__all__ = ["WeightReloadExtension", "WeightSource", "advance_follower"]


@dataclass(frozen=True)
class WeightSource:
    """The weight store an engine's workers read from: a run root reopened in each worker.

    Plain data, sent as a dict through vLLM's RPC. `storage_options` are those the run was
    opened with (endpoint, fsspec options); credentials normally come from each worker's
    environment. `hold`: keep the last version between updates so deltas apply to it."""

    run_uri: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    hold: bool = True

    @classmethod
    def of(cls, run: Location, weights: WeightsConfig) -> WeightSource:
        """The weight store of the run at `run`, as `weights` publishes it: holding is worth
        its memory only when deltas are published."""
        return cls(run.uri, run.storage_options(), hold=weights.full_every > 1)

    def open(self) -> WeightStore:
        return WeightStore(open_location(self.run_uri, storage_options=self.storage_options))

    def __repr__(self) -> str:  # never show storage options: they may hold credentials
        return f"WeightSource({self.run_uri!r}, hold={self.hold})"


class WeightReloadExtension:
    """Mixed into every vLLM worker: build a version from the weight store, load it in place."""

    _streamrl_source: WeightSource | None = None
    _streamrl_follower: WeightFollower | None = None

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
        return asdict(advance_follower(self._streamrl_follower, newer_than, skip, exactly))

    def apply_streamrl_weights(self) -> None:
        """Load the version `prepare_streamrl_weights` built in place, re-pack a tied lm_head,
        then drop the tensors unless the follower holds them for the next delta."""
        follower = self._streamrl_follower
        if follower is None:
            raise RuntimeError("apply_streamrl_weights before prepare_streamrl_weights")
        runner = self.model_runner  # type: ignore[attr-defined]
        # vLLM's loaders copy into the parameters (`copy_` casts: tensors published in another
        # dtype than the engine's load as they are) and keep no reference to them, so the held
        # tensors, which the next delta changes in place, never alias live weights (both
        # checked on vLLM 0.32's CPU backend).
        runner.reload_weights(weights_iterator=iter(follower.tensors().items()))
        _repack_tied_lm_head(runner.get_model())
        follower.release()


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
