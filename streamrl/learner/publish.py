"""Publishing policy versions from every learner rank, off the training path.

`WeightPublisher.publish(model, version)` is called by every rank at the end of a publishing
step (a collective). It
1. waits for this rank's previous upload and learns from rank 0 whether that version was
   committed (versions commit in order and are never skipped; every rank moves its delta base
   on rank 0's word);
2. agrees with rank 0 on how to store the version: skip it (an earlier life of the run
   published it), full, or a delta against the previous version (`weights.full_every`; only
   when this life committed the previous version);
3. snapshots this rank's FSDP2 shard of every parameter into host buffers in
   `weights.dtype` (refusing NaN/inf on any rank before anything is written);
4. leaves the version in this rank's hand-off slot, when engines were placed beside it
   (`streamrl.placement.handoff`: a device-to-device copy);
5. hands the upload to a background thread: `WeightWriter.write_share` of this rank's pieces,
   then, on rank 0, `commit` (waits for every rank's part, writes the manifest, moves LATEST)
   and `retain`. Training goes on meanwhile.

No host ever holds the whole model: each rank uploads its own shard. Host memory per rank: two
sets of buffers the size of its shard in `weights.dtype` (the version being uploaded, and the
base of the next delta), reused from version to version, plus the serialised files in flight
(bounded by the store).

A failed upload or commit (a storage error) is retried in the background, up to
`weights.publish_attempts` times with back-off. A version that still could not be committed
(or a rank that gave up, or `publish_timeout_s` passed) fails the learner with
`PublishFailedError` naming the storage error — at the next publish, at `flush` (before any
checkpoint, so no checkpoint ever records a version that was not committed), or at once while
the learner waits for data (`check_failed`). The learner never goes on measuring staleness
against a version no generator can ever load.

With `weights.background` false, `publish` waits for its own upload (the step pays for it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from math import prod
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from storage.control.lease import LeaseLostError
from storage.fs import StorageError
from storage.weights.manifest import SharePart
from storage.weights.publish import PublishAbandonedError, WeightWriter
from storage.weights.shares import (
    NonFiniteWeightsError,
    TensorShare,
    new_publish_id,
    non_finite,
    non_finite_message,
)
from streamrl.learner.config import WeightsConfig
from streamrl.learner.topology import Topology
from streamrl.placement.handoff import HandOffWriter

__all__ = [
    "PublishFailedError",
    "PublishReport",
    "Shares",
    "WeightPublisher",
    "local_shares",
    "tensor_share",
]

log = logging.getLogger(__name__)

_UPLOAD_NICE = 10  # CPU share of the upload thread when it competes with training: ~1/10


class PublishFailedError(RuntimeError):
    """A weight version could not be committed within `weights.publish_attempts`; the message
    names the storage error."""


@dataclass(frozen=True)
class PublishReport:
    """What one rank's background publish did.

    `share_written`: this rank's pieces and part record are in the store. `committed`: the
    version is committed — known on rank 0 only (None on other ranks, whose share may be in
    while the version still failed). `error`: why this rank's part of the job failed (None on
    success). Every rank learns the version's fate from rank 0 (`WeightPublisher._settle`)."""

    version: int
    share_written: bool
    committed: bool | None
    full: bool
    stored_bytes: int
    upload_s: float
    attempts: int = 1
    error: BaseException | None = None


Shares = dict[str, tuple[torch.Tensor, int, tuple[int, ...]]]  # name → (local, start, shape)


def tensor_share(value: torch.Tensor, is_main: bool) -> tuple[torch.Tensor, int, tuple[int, ...]]:
    """This rank's piece of one state-dict tensor: (local data, flat start, global shape). An
    FSDP2 parameter sharded on dim 0 is a range of rows, hence of flattened elements; anything
    not sharded is taken whole by the main rank only (others: empty)."""
    shape = tuple(value.shape)
    if isinstance(value, DTensor):
        _, offset = compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements
        )
        local = value.to_local()
        start = offset[0] * prod(shape[1:]) if shape else 0
        return local, start if local.numel() else 0, shape
    return (value if is_main else value.new_empty(0)), 0, shape


def local_shares(model: nn.Module, is_main: bool) -> Shares:
    """This rank's piece (`tensor_share`) of every tensor of `model`'s state dict."""
    return {name: tensor_share(v, is_main) for name, v in get_model_state_dict(model).items()}


class WeightPublisher:
    """Publishes versions of the policy from every rank (see the module docstring)."""

    def __init__(
        self,
        store: WeightWriter,
        topology: Topology,
        config: WeightsConfig,
        dtype: torch.dtype,
        model_config: dict[str, Any] | None = None,
        shares: Callable[[nn.Module, bool], Shares] = local_shares,
        handoff: HandOffWriter | None = None,
    ) -> None:
        _settle_training_threads()
        self.store, self.topology, self.config = store, topology, config
        self.shares = shares  # what of the model a version holds (LoRA: the adapter)
        self.handoff = handoff  # engines beside this rank take versions from its memory
        self.dtype, self.model_config = dtype, model_config or {}
        # One id for this life's files on every rank: a dead life's leftovers never mix in.
        self.publish_id = topology.broadcast_object(new_publish_id())
        self._pending: tuple[threading.Thread, Future[PublishReport]] | None = None
        self._snapshot: dict[str, torch.Tensor] = {}  # the version being uploaded
        self._base: dict[str, torch.Tensor] = {}  # the last committed version's data
        self._layout: dict[str, tuple[int, tuple[int, ...]]] = {}  # name → (start, shape)
        self._committed: int | None = None  # the last version this life committed
        self._unreported: PublishReport | None = None
        self._deltas_since_full = 0  # deltas since the last committed full version
        self.retries = 0  # rank 0: upload attempts beyond the first, over this life

    def publish(self, model: nn.Module, version: int) -> dict[str, float]:
        """Publish `model` as `version` (every rank calls it). Returns metrics: the seconds
        the training path lost (`perf/weight_sync_s`) and, once the previous background
        publish finished, what it did (`weights/*`, `perf/weight_upload_s`). Raises
        `PublishFailedError` on every rank if the previous version could not be committed."""
        started = time.perf_counter()
        self._settle()
        plan = self.topology.decide_on_main(lambda: self._plan(version))
        handoff_s = None
        if plan == "skip":
            log.info("weights v%d already published; not publishing again", version)
            self._committed = None  # its data is not held here: the next version is full
        else:
            shares = self._take_snapshot(model, version)
            if self.handoff is not None:
                handoff_s = self.handoff.write(version, self.publish_id, shares, self.dtype)
            self._start(version, version - 1 if plan == "delta" else None)
            if not self.config.background:
                self._settle()
        metrics = self._report_metrics()
        metrics["perf/weight_sync_s"] = time.perf_counter() - started
        if handoff_s is not None:
            metrics["perf/weight_handoff_s"] = handoff_s
        return metrics

    def close(self) -> None:
        """Remove this rank's hand-off slots (engines beside it read storage from now on)."""
        if self.handoff is not None:
            self.handoff.close()

    def flush(self) -> None:
        """Wait for the upload in progress; raises `PublishFailedError` on every rank if its
        version could not be committed (a collective)."""
        self._settle()

    def check_failed(self) -> None:
        """Rank 0, without waiting: raise `PublishFailedError` if the upload in progress has
        already failed for good (a learner waiting for data must not wait for a version that
        will never be committed)."""
        pending = self._pending  # the main thread may settle it meanwhile
        if pending is None or not pending[1].done():
            return
        report = pending[1].result()
        if report.committed is False:
            raise self._failure(report)

    # -- steps of a publish ----------------------------------------------------------------

    def _settle(self) -> None:
        """Wait for this rank's upload, then learn from rank 0 whether the version committed:
        every rank moves its delta base (or fails) on rank 0's word, never on its own share's
        fate (a share can land although its writer saw an error)."""
        if self._pending is None:
            return
        (thread, future), self._pending = self._pending, None
        thread.join()
        report = future.result()  # _upload never raises: a failure is a report
        self._unreported = report

        def verdict() -> bool:
            if not report.committed:
                raise self._failure(report)
            return report.full

        full = self.topology.decide_on_main(verdict)
        self._base, self._snapshot = self._snapshot, self._base
        self._committed = report.version
        self._deltas_since_full = 0 if full else self._deltas_since_full + 1

    def _failure(self, report: PublishReport) -> Exception:
        cause = report.error
        if isinstance(cause, LeaseLostError):
            return cause  # the learner stops as displaced: not a storage error
        return PublishFailedError(
            f"weights v{report.version} could not be committed to {self.store.root.uri} after "
            f"{report.attempts} attempt(s) (weights.publish_attempts="
            f"{self.config.publish_attempts}): {cause!r}. LATEST still names the last complete "
            "version and the last checkpoint is intact: fix the storage (credentials, space, "
            "reachability; a rank slower than weights.publish_timeout_s: raise it), then resume"
        )

    def _plan(self, version: int) -> str:
        """On rank 0: skip, full or delta for `version`."""
        if version in self.store.reader.versions():  # an earlier life of this run published it
            return "skip"
        previous_ok = self._committed == version - 1
        if previous_ok and self._deltas_since_full + 1 < self.config.full_every:
            return "delta"
        return "full"

    def _take_snapshot(self, model: nn.Module, version: int) -> Shares:
        """Copy this rank's shard into the snapshot buffers (allocated once, pinned on CUDA),
        after every rank checked that it holds no NaN/inf; the shard's pieces."""
        shares = self.shares(model, self.topology.is_main)
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
        return shares

    def _start(self, version: int, base_version: int | None) -> None:
        """Upload in a daemon thread: a learner that fails is not held up by an upload (or a
        commit waiting for a dead rank's part); its version is simply never committed."""
        future: Future[PublishReport] = Future()

        def run() -> None:
            _leave_cores_to_training()
            future.set_result(self._upload(version, base_version))

        thread = threading.Thread(target=run, name=f"publish-v{version}", daemon=True)
        thread.start()
        self._pending = (thread, future)

    def _upload(self, version: int, base_version: int | None) -> PublishReport:
        """Write this rank's share (up to `publish_attempts` times; a retry writes the same
        bytes under the same names, so a share that landed although its writer saw an error is
        never changed under a commit), then on rank 0 commit (as often) and retain. Never
        raises: a failure is a report."""
        started, attempts = time.perf_counter(), self.config.publish_attempts
        topology = self.topology
        where = {"publish_id": self.publish_id, "rank": topology.rank, "world": topology.world_size}
        part, error = None, None
        for attempt in range(1, attempts + 1):
            try:
                part = self._write_share(version, base_version, where)
                break
            except LeaseLostError as exc:
                error = exc
                break
            except Exception as exc:  # retried, then the version fails the learner
                error = exc
                log.warning("rank %d could not write its share of weights v%d (attempt %d/%d):"
                            " %r", topology.rank, version, attempt, attempts, exc)  # fmt: skip
                if attempt < attempts:
                    self.retries += 1
                    time.sleep(_backoff_s(attempt))
        elapsed = time.perf_counter() - started
        if part is None:
            try:  # rank 0's commit then stops waiting for this share at once
                self.store.abandon_share(version, error=repr(error), **where)
            except Exception as again:  # rank 0 then gives up after weights.publish_timeout_s
                log.warning("could not record that failure either: %r", again)
            committed = False if topology.is_main else None  # only rank 0 ever knows
            return PublishReport(version, False, committed, True, 0, elapsed, attempts, error)
        stored, full = sum(f.size for f in part.files), part.base is None
        if not topology.is_main:
            return PublishReport(version, True, None, full, stored, elapsed, attempt)
        return self._commit(version, attempt, started)

    def _write_share(
        self, version: int, base_version: int | None, where: dict[str, Any]
    ) -> SharePart:
        shares = {name: TensorShare(self._snapshot[name], *at) for name, at in self._layout.items()}
        base = None
        if base_version is not None:
            base = (base_version, {name: self._base[name] for name in shares})
        cfg = self.config
        return self.store.write_share(
            version,
            shares,
            base=base,
            shard_bytes=cfg.shard_bytes,
            max_delta_ratio=cfg.max_delta_ratio,
            **where,
        )

    def _commit(self, version: int, attempts_so_far: int, started: float) -> PublishReport:
        """Rank 0: commit `version` once every rank's share is in (retrying storage errors of
        the commit itself; a rank that gave up, or the timeout, fails the version)."""
        cfg, manifest, error = self.config, None, None
        for attempt in range(1, cfg.publish_attempts + 1):
            try:
                manifest = self.store.commit(
                    version,
                    publish_id=self.publish_id,
                    world=self.topology.world_size,
                    model_config=self.model_config,
                    timeout_s=cfg.publish_timeout_s,
                )
                break
            except (LeaseLostError, PublishAbandonedError) as exc:  # final: no retry helps
                error = exc
                break
            except Exception as exc:  # a storage error writing the manifest or LATEST
                error = exc
                log.warning("weights v%d: commit attempt %d/%d failed: %r",
                            version, attempt, cfg.publish_attempts, exc)  # fmt: skip
                if attempt < cfg.publish_attempts:
                    self.retries += 1
                    time.sleep(_backoff_s(attempt))
        elapsed = time.perf_counter() - started
        if manifest is None:
            log.warning("weights v%d not published: %r", version, error)
            return PublishReport(version, True, False, True, 0, elapsed, attempts_so_far, error)
        try:
            self.store.retain(cfg.keep_versions)
        except LeaseLostError as exc:  # committed, but this learner stops
            return PublishReport(version, True, False, True, 0, elapsed, attempts_so_far, exc)
        except (OSError, StorageError) as exc:  # the next publish retains again
            log.warning("could not remove old weight versions: %r", exc)
        return PublishReport(
            version, True, True, manifest.is_full, manifest.stored_bytes, elapsed, attempts_so_far
        )

    def _report_metrics(self) -> dict[str, float]:
        report, self._unreported = self._unreported, None
        if report is None:
            return {}
        return {
            "perf/weight_upload_s": report.upload_s,
            "weights/stored_bytes": float(report.stored_bytes),
            "weights/full": float(report.full),
            "weights/publish_retries_total": float(self.retries),
        }


def _backoff_s(attempt: int) -> float:
    """Seconds before upload attempt `attempt + 1`: 2, 4, 8, ... up to 30."""
    return min(2.0**attempt, 30.0)


def _settle_training_threads() -> None:
    """Fix the process's threading state now, on the training thread, before any step.

    `_leave_cores_to_training` calls `torch.set_num_threads`, which besides the upload thread's
    own count turns MKL's dynamic thread count off for the whole process. MKL calls made inside
    OpenMP regions (the CPU flash-attention backward) give different bits with it on and off,
    so left to the upload thread the switch would land at whatever moment that thread first got
    the CPU (later on a loaded machine), and a replay would be bit-identical only on an idle
    one. Setting the training thread's own count here makes the switch before anything is
    trained; nothing the upload threads do later changes it."""
    torch.set_num_threads(torch.get_num_threads())


def _leave_cores_to_training() -> None:
    """Make this (upload) thread stay out of the training step's way.

    Its torch work (delta encoding, the store's finite check, serialising copies) runs on one
    intra-op thread: the training step's reductions then always run on the same OpenMP team
    and MKL thread count, whatever the upload does at the same moment, so background
    publishing never changes the learner's arithmetic (resume stays bit-identical). (In
    OpenMP builds the count is per thread; `set_num_threads` also turns MKL's dynamic thread
    count off.) And its CPU priority is lowered (Linux: threads have their own nice value),
    so serialising and hashing take the cores the step leaves idle."""
    torch.set_num_threads(1)
    with contextlib.suppress(OSError, AttributeError):  # not Linux, or not permitted
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _UPLOAD_NICE)
