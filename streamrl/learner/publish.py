"""Publishing policy versions from every learner rank, off the training path.

`WeightPublisher.publish(model, version)` is called by every rank at the end of a publishing
step (a collective). It
1. waits for this rank's previous upload (the rule for a publish still running when the next
   is due: wait, so versions commit in order and a delta's base is always committed);
2. agrees with rank 0 on how to store the version: skip it (an earlier life of the run
   published it), full, or a delta against the previous version (`weights.full_every`; only
   when this life committed the previous version);
3. snapshots this rank's FSDP2 shard of every parameter into host buffers in
   `weights.dtype` (refusing NaN/inf on any rank before anything is written);
4. hands the upload to a background thread: `WeightStore.write_share` of this rank's pieces,
   then, on rank 0, `commit` (waits for every rank's part, writes the manifest, moves LATEST)
   and `retain`. Training goes on meanwhile.

No host ever holds the whole model: each rank uploads its own shard. Host memory per rank: two
sets of buffers the size of its shard in `weights.dtype` (the version being uploaded, and the
base of the next delta), reused from version to version, plus the serialised files in flight
(bounded by the store). A failed upload (storage error, a rank that never reports) does not
stop training: the version is not committed, LATEST stays on the last complete version, the
failure is logged and counted, and the next version is published full.

With `weights.background` false, `publish` waits for its own upload (the step pays for it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from math import prod
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from storage.fs import StorageError
from storage.weight_shares import (
    NonFiniteWeightsError,
    TensorShare,
    new_publish_id,
    non_finite,
    non_finite_message,
)
from storage.weights import WeightStore
from streamrl.config import WeightsConfig
from streamrl.learner.topology import Topology

__all__ = ["PublishReport", "WeightPublisher", "local_shares"]

log = logging.getLogger(__name__)

_UPLOAD_NICE = 10  # CPU share of the upload thread when it competes with training: ~1/10


@dataclass(frozen=True)
class PublishReport:
    """What a finished background publish did (on rank 0: the version's fate)."""

    version: int
    committed: bool
    full: bool
    stored_bytes: int
    upload_s: float


def local_shares(
    model: nn.Module, is_main: bool
) -> dict[str, tuple[torch.Tensor, int, tuple[int, ...]]]:
    """This rank's piece of every tensor of `model`'s state dict: (local data, flat start,
    global shape). An FSDP2 parameter sharded on dim 0 is a range of rows, hence of flattened
    elements; anything not sharded is taken whole by the main rank only (others: empty)."""
    shares: dict[str, tuple[torch.Tensor, int, tuple[int, ...]]] = {}
    for name, value in get_model_state_dict(model).items():
        if isinstance(value, DTensor):
            shape = tuple(value.shape)
            _, offset = compute_local_shape_and_global_offset(
                value.shape, value.device_mesh, value.placements
            )
            local = value.to_local()
            start = offset[0] * prod(shape[1:]) if shape else 0
            shares[name] = (local, start if local.numel() else 0, shape)
        else:
            whole = value if is_main else value.new_empty(0)
            shares[name] = (whole, 0, tuple(value.shape))
    return shares


class WeightPublisher:
    """Publishes versions of the policy from every rank (see the module docstring)."""

    def __init__(
        self,
        store: WeightStore,
        topology: Topology,
        config: WeightsConfig,
        dtype: torch.dtype,
        model_config: dict[str, Any] | None = None,
    ) -> None:
        self.store, self.topology, self.config = store, topology, config
        self.dtype, self.model_config = dtype, model_config or {}
        # One id for this life's files on every rank: a dead life's leftovers never mix in.
        self.publish_id = topology.broadcast_object(new_publish_id())
        self._pending: tuple[threading.Thread, Future[PublishReport]] | None = None
        self._snapshot: dict[str, torch.Tensor] = {}  # the version being uploaded
        self._base: dict[str, torch.Tensor] = {}  # the last version this rank wrote
        self._layout: dict[str, tuple[int, tuple[int, ...]]] = {}  # name → (start, shape)
        self._last: PublishReport | None = None  # the last finished publish of this life
        self._unreported: PublishReport | None = None
        self._deltas_since_full = 0  # rank 0: deltas since the last committed full version
        self.failures = 0  # rank 0: versions not committed

    def publish(self, model: nn.Module, version: int) -> dict[str, float]:
        """Publish `model` as `version` (every rank calls it). Returns metrics: the seconds
        the training path lost (`perf/weight_sync_s`) and, once the previous background
        publish finished, what it did (`weights/*`, `perf/weight_upload_s`)."""
        started = time.perf_counter()
        self._wait()
        plan = self.topology.decide_on_main(lambda: self._plan(version))
        if plan == "skip":
            log.info("weights v%d already published; not publishing again", version)
            self._last = None  # its data is not held here: the next version is full
        else:
            self._take_snapshot(model, version)
            self._start(version, version - 1 if plan == "delta" else None)
            if not self.config.background:
                self._wait()
        metrics = self._report_metrics()
        metrics["perf/weight_sync_s"] = time.perf_counter() - started
        return metrics

    def flush(self) -> PublishReport | None:
        """Wait for the upload in progress (on rank 0 its commit too); returns its report."""
        self._wait()
        return self._last

    # -- steps of a publish ----------------------------------------------------------------

    def _wait(self) -> None:
        if self._pending is None:
            return
        (thread, future), self._pending = self._pending, None
        thread.join()
        report = future.result()  # _upload never raises: a failure is a report
        self._last = self._unreported = report
        if report.committed:  # on ranks ≠ 0: this rank's share was written
            self._base, self._snapshot = self._snapshot, self._base
        if self.topology.is_main:
            if report.committed:
                self._deltas_since_full = 0 if report.full else self._deltas_since_full + 1
            else:
                self.failures += 1

    def _plan(self, version: int) -> str:
        """On rank 0: skip, full or delta for `version`."""
        if version in self.store.versions():  # an earlier life of this run published it
            return "skip"
        last = self._last
        previous_ok = last is not None and last.committed and last.version == version - 1
        if previous_ok and self._deltas_since_full + 1 < self.config.full_every:
            return "delta"
        return "full"

    def _take_snapshot(self, model: nn.Module, version: int) -> None:
        """Copy this rank's shard into the snapshot buffers (allocated once, pinned on CUDA),
        after every rank checked that it holds no NaN/inf."""
        shares = local_shares(model, self.topology.is_main)
        bad = non_finite({name: local for name, (local, _, _) in shares.items()})
        total = int(self.topology.all_reduce_sum(torch.tensor([len(bad)])).item())
        if total:
            raise NonFiniteWeightsError(non_finite_message(version, bad, total))
        pinned = self.topology.device.type == "cuda"
        self._layout = {}
        for name, (local, start, shape) in shares.items():
            dtype = self.dtype if local.is_floating_point() else local.dtype
            buffer = self._snapshot.get(name)
            if buffer is None or buffer.numel() != local.numel() or buffer.dtype != dtype:
                buffer = torch.empty(local.numel(), dtype=dtype, pin_memory=pinned)
                self._snapshot[name] = buffer
            buffer.copy_(local.detach().reshape(-1), non_blocking=pinned)
            self._layout[name] = (start, shape)
        if pinned:
            torch.cuda.current_stream().synchronize()

    def _start(self, version: int, base_version: int | None) -> None:
        """Upload in a daemon thread: a learner that fails is not held up by an upload (or a
        commit waiting for a dead rank's part); its version is simply never committed."""
        future: Future[PublishReport] = Future()

        def run() -> None:
            _yield_cpu_to_training()
            future.set_result(self._upload(version, base_version))

        thread = threading.Thread(target=run, name=f"publish-v{version}", daemon=True)
        thread.start()
        self._pending = (thread, future)

    def _upload(self, version: int, base_version: int | None) -> PublishReport:
        """Write this rank's share; rank 0 also commits and retains. Never raises: a failure
        is logged and reported as not committed."""
        started = time.perf_counter()
        topology, cfg = self.topology, self.config
        shares = {name: TensorShare(self._snapshot[name], *at) for name, at in self._layout.items()}
        base = None
        if base_version is not None:
            base = (base_version, {name: self._base[name] for name in shares})
        where = {"publish_id": self.publish_id, "rank": topology.rank, "world": topology.world_size}
        try:
            part = self.store.write_share(
                version,
                shares,
                base=base,
                shard_bytes=cfg.shard_bytes,
                max_delta_ratio=cfg.max_delta_ratio,
                **where,
            )
        except Exception as exc:  # counted and logged; the next version is published full
            log.warning("rank %d could not write its share of weights v%d: %r",
                        topology.rank, version, exc)  # fmt: skip
            try:
                self.store.abandon_share(version, error=repr(exc), **where)
            except Exception as again:  # rank 0 then gives up after weights.publish_timeout_s
                log.warning("could not record that failure either: %r", again)
            return PublishReport(version, False, True, 0, time.perf_counter() - started)
        if not topology.is_main:
            stored = sum(f.size for f in part.files)
            elapsed = time.perf_counter() - started
            return PublishReport(version, True, part.base is None, stored, elapsed)
        try:
            manifest = self.store.commit(
                version,
                publish_id=self.publish_id,
                world=topology.world_size,
                model_config=self.model_config,
                timeout_s=cfg.publish_timeout_s,
            )
        except Exception as exc:  # counted and logged; LATEST stays on the last version
            log.warning("weights v%d not published: %s", version, exc)
            return PublishReport(version, False, True, 0, time.perf_counter() - started)
        try:
            self.store.retain(cfg.keep_versions)
        except (OSError, StorageError) as exc:  # the next publish retains again
            log.warning("could not remove old weight versions: %r", exc)
        elapsed = time.perf_counter() - started
        return PublishReport(version, True, manifest.is_full, manifest.stored_bytes, elapsed)

    def _report_metrics(self) -> dict[str, float]:
        report, self._unreported = self._unreported, None
        if report is None:
            return {}
        return {
            "perf/weight_upload_s": report.upload_s,
            "weights/stored_bytes": float(report.stored_bytes),
            "weights/full": float(report.full),
            "weights/publish_failures_total": float(self.failures),
        }


def _yield_cpu_to_training() -> None:
    """Lower this thread's CPU priority (Linux: threads have their own nice value), so the
    upload's serialising and hashing take the cores the training step leaves idle rather than
    slowing the step down."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux, or not permitted
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _UPLOAD_NICE)
