"""One learner per run: a lease with an epoch, held while the learner writes the run.

    <run>/control/lease/<epoch:08d>.json   {"epoch", "holder", "expires_at", "released"}

Taking the run means creating the next epoch's record with `put_if_absent`: of two learners
racing for epoch N+1 exactly one wins. The holder of epoch N renews its record (the expiry moves
`ttl_s` ahead) from a background thread every `ttl_s / 3`, and releases it when it ends. A
learner may take over when the newest record has expired or was released, or — `take_over`,
what a supervisor does once it saw the previous learner end — at once.

Every write that a second learner could clobber (a checkpoint's COMMITTED, a weight manifest,
LATEST, retention deletions, progress and metrics records) calls `RunLease.check()` right before
it: it raises `LeaseLostError` once a newer epoch exists — a successor creates its epoch before
it writes anything, and the object store is read-after-write consistent, so a holder that was
stopped (SIGSTOP, a frozen VM) or cut off from storage past its expiry sees the take-over at its
next check. Such a learner stops without writing anything more. A lapsed lease alone does not
stop a holder: with no successor, it renews and goes on (a storage outage is ridden out). What a
check cannot close is the time between the check and the end of the write it guards; that write
is one small object, and readers trust only what a commit record names.

Clocks: a successor compares the record's wall-clock `expires_at` with its own clock, so hosts'
clocks must agree to well within `ttl_s`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass

from storage.fs import Location, StorageError, put_if_absent, replace_object

__all__ = [
    "DISPLACED",
    "NOT_HOLDER_EXIT_CODE",
    "LeaseHeldError",
    "LeaseLostError",
    "LeaseRecord",
    "RunLease",
    "read_lease",
]

log = logging.getLogger(__name__)

# A learner process that refused to start (another learner holds the run) or stopped because
# another took the run over exits with this code: supervisors do not restart it.
NOT_HOLDER_EXIT_CODE = 3
# How the learner says so (under torchrun a rank's exit code is lost), and a supervisor when
# it stops the run for that reason (a flow run's state message carries it to the supervisor
# of a run on work pools).
DISPLACED = "another learner holds the run's lease"

_RECORD = re.compile(r"^(\d{8})\.json$")


class LeaseHeldError(RuntimeError):
    """Another learner holds the run's lease; the message names it and how to take over."""


class LeaseLostError(RuntimeError):
    """This learner no longer holds the run's lease: it must write nothing more."""


@dataclass(frozen=True)
class LeaseRecord:
    """One epoch of the run's lease. Invariants: epoch ≥ 1; `holder` a non-empty description
    (host, pid, an id); `expires_at` a wall-clock time (seconds since the epoch)."""

    epoch: int
    holder: str
    expires_at: float
    released: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 1:
            raise ValueError(f"epoch must be an integer ≥ 1, got {self.epoch!r}")
        if not isinstance(self.holder, str) or not self.holder:
            raise ValueError("holder must be a non-empty string")
        if not isinstance(self.expires_at, int | float) or self.expires_at != self.expires_at:
            raise ValueError(f"expires_at must be a number, got {self.expires_at!r}")
        if not isinstance(self.released, bool):
            raise ValueError(f"released must be true or false, got {self.released!r}")

    def live(self, now: float) -> bool:
        return not self.released and now < self.expires_at

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> LeaseRecord:
        try:
            raw = json.loads(data)
            if not isinstance(raw, dict):
                raise ValueError("not a JSON object")
            return cls(
                epoch=raw["epoch"],
                holder=raw["holder"],
                expires_at=raw["expires_at"],
                released=raw.get("released", False),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise StorageError(f"the run's lease record {where} is malformed: {exc}") from exc


def _folder(run: Location) -> Location:
    return run.child("control", "lease")


def _epochs(run: Location) -> list[int]:
    """The epochs recorded, oldest first (names that are not `<8 digits>.json` are ignored)."""
    folder = _folder(run)
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in folder.fs.ls(folder.path, detail=False)]
    except FileNotFoundError:
        return []
    return sorted(int(m[1]) for m in map(_RECORD.match, names) if m)


def _record_path(run: Location, epoch: int) -> str:
    return _folder(run).join(f"{epoch:08d}.json")


def read_lease(run: Location) -> LeaseRecord | None:
    """The newest epoch's record, or None for a run no learner ever held."""
    epochs = _epochs(run)
    if not epochs:
        return None
    path = _record_path(run, epochs[-1])
    record = LeaseRecord.from_json(run.fs.cat_file(path), path)
    if record.epoch != epochs[-1]:
        raise StorageError(f"the run's lease record {path} names epoch {record.epoch}")
    return record


def _describe_holder() -> str:
    return f"{socket.gethostname()} pid {os.getpid()} ({uuid.uuid4().hex[:8]})"


class RunLease:
    """This learner's hold on a run (see the module docstring). `acquire` takes it and starts
    renewing; `check()` guards every write; `release()` ends it (also as a context manager)."""

    def __init__(self, run: Location, record: LeaseRecord, ttl_s: float) -> None:
        self.run, self.epoch, self.holder, self.ttl_s = run, record.epoch, record.holder, ttl_s
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, name="run-lease", daemon=True)
        self._thread.start()

    @classmethod
    def acquire(
        cls, run: Location, *, ttl_s: float, take_over: bool = False, holder: str | None = None
    ) -> RunLease:
        """Take the run for this learner. Raises `LeaseHeldError` if another learner holds it
        (live record, `take_over` false) or wins the race for the next epoch."""
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        holder = holder or _describe_holder()
        try:
            current = read_lease(run)
        except StorageError as exc:
            if not take_over:
                raise LeaseHeldError(
                    f"{exc}. Nothing was written. If no other learner runs on {run.uri}, start "
                    "this one with --take-over"
                ) from exc
            epochs = _epochs(run)
            current = LeaseRecord(epochs[-1], "unknown (malformed record)", 0.0)
        now = time.time()
        if current is not None and current.live(now) and not take_over:
            raise LeaseHeldError(
                f"{DISPLACED} ({run.uri}): {current.holder} (lease epoch "
                f"{current.epoch}, renewed until {time.ctime(current.expires_at)}, "
                f"{current.expires_at - now:.0f} s from now). Two learners must never write one "
                "run. If that learner is gone (its process or pod ended), wait until the lease "
                "expires or start this one with --take-over; the old holder then writes nothing "
                "more"
            )
        epoch = 1 if current is None else current.epoch + 1
        record = LeaseRecord(epoch, holder, time.time() + ttl_s)
        if not put_if_absent(run.fs, _record_path(run, epoch), record.to_json()):
            raise LeaseHeldError(
                f"{DISPLACED} ({run.uri}): it took the run at the same moment (epoch {epoch}); "
                "this one wrote nothing. Two learners must never write one run"
            )
        if current is not None and current.live(now):
            log.warning("took run %s over from %s (lease epoch %d)", run.uri, current.holder, epoch)
        return cls(run, record, ttl_s)

    def check(self) -> int:
        """The epoch held, right before a write; raises `LeaseLostError` if it is not held."""
        if self._lost is None and (newer := self._newer_epoch()) is not None:
            self._lose(f"another learner took the run over (lease epoch {newer})")
        if self._lost is not None:
            raise LeaseLostError(
                f"{DISPLACED} ({self.run.uri}) now: {self._lost}. This one stops "
                "without writing anything more"
            )
        return self.epoch

    @property
    def held(self) -> bool:
        return self._lost is None

    def release(self) -> None:
        """Stop renewing; mark the record released (a successor need not wait for expiry)."""
        self._stop.set()
        self._thread.join()
        if self._lost is not None or self._newer_epoch() is not None:
            return
        record = LeaseRecord(self.epoch, self.holder, time.time(), released=True)
        try:
            replace_object(self.run, _record_path(self.run, self.epoch), record.to_json())
        except (OSError, StorageError) as exc:  # it expires by itself
            log.warning("could not release the run's lease (it expires by itself): %r", exc)

    def __enter__(self) -> RunLease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    # -- renewal -----------------------------------------------------------------------------

    def _newer_epoch(self) -> int | None:
        """The next epoch, if a successor took it (epochs are taken one after another, so any
        newer epoch implies this one's successor exists: one HEAD request)."""
        following = self.epoch + 1
        return following if self.run.fs.exists(_record_path(self.run, following)) else None

    def _lose(self, why: str) -> None:
        if self._lost is None:
            self._lost = why
            log.error("lost the lease on run %s: %s", self.run.uri, why)

    def _renew_loop(self) -> None:
        """Every ttl/3: unless a newer epoch exists, move this epoch's expiry ttl ahead. A failed
        renewal (storage unreachable) is retried at the next tick: meanwhile the lease may
        lapse and a successor take over, which `check` then sees."""
        while not self._stop.wait(self.ttl_s / 3):
            try:
                newer = self._newer_epoch()
                if newer is not None:
                    self._lose(f"another learner took the run over (lease epoch {newer})")
                    return
                record = LeaseRecord(self.epoch, self.holder, time.time() + self.ttl_s)
                replace_object(self.run, _record_path(self.run, self.epoch), record.to_json())
            except Exception as exc:  # any backend's error: the lease may lapse, see above
                log.warning("could not renew the run's lease (epoch %d): %r", self.epoch, exc)
