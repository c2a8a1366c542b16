"""One learner per run: a lease with an epoch, held while the learner writes the run.

    <run>/control/lease/<epoch:08d>.json  {"epoch", "holder", "expires_at", "released", "ttl_s"}

Taking the run means creating the next epoch's record with `create_once` (create if absent; a
retried request of this learner's own that had landed is recognised by reading the record back): of
two learners racing for epoch N+1 exactly one wins. The holder of epoch N renews its record (the
expiry moves `ttl_s` ahead) from a background thread every `ttl_s / 3`, and releases it when it
ends. A learner may take over when the newest record lapsed (see Clocks) or was released, or —
`take_over`, what a supervisor does once it saw the previous learner end — at once. The same lease
holds a generator's index (`streamrl.supervision.launch`); `kind` names the holder in messages.

Every write that a second learner could clobber (a checkpoint's COMMITTED, a weight manifest,
LATEST, retention deletions, progress and metrics records) calls `RunLease.check()` right before
it: it raises `LeaseLostError` once a newer epoch exists — a successor creates its epoch before
it writes anything, and the object store is read-after-write consistent, so a holder that was
stopped (SIGSTOP, a frozen VM) or cut off from storage past its expiry sees the take-over at its
next check. Such a learner stops without writing anything more. A lapsed lease alone does not
stop a holder: with no successor, it renews and goes on (a storage outage is ridden out). What a
check cannot close is the time between the check and the end of the write it guards; that write
is one small object, and readers trust only what a commit record names.

Clocks: no two machines' clocks are ever compared. A record's `expires_at` is the holder's
own clock, for people to read. A newcomer judges a record on its own clock: it watches the
record for `ttl_s`, and a holder that renewed it in that time is alive (the newcomer refuses),
one that did not has lapsed (the newcomer takes the next epoch). So a live holder is refused
within a renewal period (`ttl_s / 3`), a crashed one is taken over after `ttl_s`, whatever the
clocks say.

Stores: taking an epoch relies on the store refusing a second create of one name
(`If-None-Match: *` on S3). `check_conditional_writes` probes that once per store before the
first epoch is taken, and refuses a store that ignores it (some S3-compatible gateways do),
naming it. Should a store still let a second create through, the holder finds out at its next
check or renewal: it reads its own epoch's record back and compares the holder.
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
from collections.abc import Callable
from dataclasses import asdict, dataclass

from storage.fs import (
    Location,
    StorageError,
    check_conditional_writes,
    create_once,
    replace_object,
)

__all__ = [
    "DISPLACED",
    "NOT_HOLDER_EXIT_CODE",
    "LeaseHeldError",
    "LeaseLostError",
    "LeaseRecord",
    "RunLease",
    "lives",
    "read_lease",
]

LEARNER = ("learner", "the run")
"""Whose lease: the kind of holder and what it holds (`RunLease.acquire(..., kind=...)`)."""

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
    ttl_s: float | None = None  # how long the holder goes unrenewed before it lapses

    def __post_init__(self) -> None:
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 1:
            raise ValueError(f"epoch must be an integer ≥ 1, got {self.epoch!r}")
        if not isinstance(self.holder, str) or not self.holder:
            raise ValueError("holder must be a non-empty string")
        if not isinstance(self.expires_at, int | float) or self.expires_at != self.expires_at:
            raise ValueError(f"expires_at must be a number, got {self.expires_at!r}")
        if not isinstance(self.released, bool):
            raise ValueError(f"released must be true or false, got {self.released!r}")
        if self.ttl_s is not None and not (isinstance(self.ttl_s, int | float) and self.ttl_s > 0):
            raise ValueError(f"ttl_s must be a number > 0, got {self.ttl_s!r}")

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
                ttl_s=raw.get("ttl_s"),
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


def lives(run: Location) -> tuple[int, int] | None:
    """(restarts, resumes) of the holders of `run`'s lease, None if nobody ever held it: each
    epoch after the first is a resume when the one before it was released (its holder stopped
    cleanly), else a restart (it crashed, was killed, or was taken over). An unreadable record
    counts as not released."""
    released = []
    for epoch in _epochs(run):
        path = _record_path(run, epoch)
        try:
            released.append(LeaseRecord.from_json(run.fs.cat_file(path), path).released)
        except (StorageError, FileNotFoundError):
            released.append(False)
    if not released:
        return None
    resumes = sum(released[:-1])
    return len(released) - 1 - resumes, resumes


def _describe_holder() -> str:
    return f"{socket.gethostname()} pid {os.getpid()} ({uuid.uuid4().hex[:8]})"


class RunLease:
    """This process's hold on a run (see the module docstring). `acquire` takes it and starts
    renewing; `check()` guards every write; `release()` ends it (also as a context manager).
    `kind`: (holder kind, what is held) for messages — a learner holds the run, a generator
    its index."""

    def __init__(
        self,
        run: Location,
        record: LeaseRecord,
        ttl_s: float,
        kind: tuple[str, str] = LEARNER,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.run, self.epoch, self.holder, self.ttl_s = run, record.epoch, record.holder, ttl_s
        self.kind, self._clock = kind, clock
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, name="run-lease", daemon=True)
        self._thread.start()

    @classmethod
    def acquire(
        cls,
        run: Location,
        *,
        ttl_s: float,
        take_over: bool = False,
        holder: str | None = None,
        kind: tuple[str, str] = LEARNER,
        clock: Callable[[], float] = time.time,
    ) -> RunLease:
        """Take `run` for this process. Without `take_over`, a record neither released nor
        lapsed (watched for `ttl_s` on this process's clock, module docstring) is refused with
        `LeaseHeldError`, as is losing the race for the next epoch. `clock`: the wall clock
        written into the records (the holder's; nobody else compares it)."""
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        check_conditional_writes(run)
        holder = holder or _describe_holder()
        held = _held_message(run, kind)
        try:
            current = read_lease(run)
        except StorageError as exc:
            if not take_over:
                raise LeaseHeldError(
                    f"{exc}. Nothing was written. If no other {kind[0]} runs on {run.uri}, "
                    "start this one with --take-over"
                ) from exc
            epochs = _epochs(run)
            current = LeaseRecord(epochs[-1], "unknown (malformed record)", 0.0)
        if current is not None and not current.released and not take_over:
            current = _watch_until_lapsed(run, current, current.ttl_s or ttl_s, held)
        epoch = 1 if current is None else current.epoch + 1
        record = LeaseRecord(epoch, holder, clock() + ttl_s, ttl_s=ttl_s)
        if not create_once(run.fs, _record_path(run, epoch), record.to_json()):
            raise LeaseHeldError(
                f"{held}: it took it at the same moment (epoch {epoch}); this one wrote nothing"
            )
        if current is not None and not current.released:
            log.warning("took %s over from %s (lease epoch %d)", run.uri, current.holder, epoch)
        return cls(run, record, ttl_s, kind, clock)

    def check(self) -> int:
        """The epoch held, right before a write; raises `LeaseLostError` if it is not held:
        a newer epoch exists, or this epoch's record names another holder (a store that let a
        second create through)."""
        if self._lost is None:
            self._look_for_successor()
        if self._lost is not None:
            raise LeaseLostError(
                f"{_held_message(self.run, self.kind)} now: {self._lost}. "
                "This one stops without writing anything more"
            )
        return self.epoch

    @property
    def held(self) -> bool:
        return self._lost is None

    def release(self) -> None:
        """Stop renewing; mark the record released (a successor need not wait for it to
        lapse). Storage that cannot be reached is logged: the record then lapses by itself.
        A second call does nothing."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        if self._lost is not None:
            return
        try:
            self._look_for_successor()
            if self._lost is not None:
                return
            record = LeaseRecord(
                self.epoch, self.holder, self._clock(), released=True, ttl_s=self.ttl_s
            )
            replace_object(self.run, _record_path(self.run, self.epoch), record.to_json())
        except Exception as exc:  # any backend's error: it lapses by itself
            log.warning(
                "could not release the lease on %s (it lapses by itself): %r", self.run.uri, exc
            )

    def __enter__(self) -> RunLease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    # -- renewal -----------------------------------------------------------------------------

    def _look_for_successor(self) -> None:
        """Lose the lease if a successor took the next epoch (one HEAD request: epochs are
        taken one after another) or this epoch's record names another holder."""
        following = self.epoch + 1
        if self.run.fs.exists(_record_path(self.run, following)):
            self._lose(f"another {self.kind[0]} took {self.kind[1]} over (lease epoch {following})")
            return
        path = _record_path(self.run, self.epoch)
        mine = LeaseRecord.from_json(self.run.fs.cat_file(path), path)
        if mine.holder != self.holder:
            self._lose(
                f"its lease record (epoch {self.epoch}) names {mine.holder}: the store let a "
                "second create of the record through"
            )

    def _lose(self, why: str) -> None:
        if self._lost is None:
            self._lost = why
            log.error("lost the lease on %s: %s", self.run.uri, why)

    def _renew_loop(self) -> None:
        """Every ttl/3: unless the lease was lost, move this epoch's expiry ttl ahead. A failed
        renewal (storage unreachable) is retried at the next tick: meanwhile the lease may
        lapse and a successor take over, which `check` then sees."""
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self._look_for_successor()
                if self._lost is not None:
                    return
                record = LeaseRecord(
                    self.epoch, self.holder, self._clock() + self.ttl_s, ttl_s=self.ttl_s
                )
                replace_object(self.run, _record_path(self.run, self.epoch), record.to_json())
            except Exception as exc:  # any backend's error: the lease may lapse, see above
                log.warning(
                    "could not renew the lease on %s (epoch %d): %r", self.run.uri, self.epoch, exc
                )


def _held_message(run: Location, kind: tuple[str, str]) -> str:
    """ "another learner holds the run's lease (<run>)" (`DISPLACED`, which supervisors look
    for), or the like for another kind of holder."""
    if kind == LEARNER:
        return f"{DISPLACED} ({run.uri})"
    return f"another {kind[0]} holds the lease on {kind[1]}"


def _watch_until_lapsed(
    run: Location, seen: LeaseRecord, ttl_s: float, held: str
) -> LeaseRecord | None:
    """Watch the newest record for `ttl_s` (the holder's, as its record says) on this process's
    clock: return it once released or unchanged for `ttl_s` (its holder stopped renewing);
    raise `LeaseHeldError` when it is renewed or another epoch appears (a live holder)."""
    log.info(
        "%s is held by %s (lease epoch %d): watching it up to %.0f s for a renewal",
        run.uri, seen.holder, seen.epoch, ttl_s,
    )  # fmt: skip
    deadline = time.monotonic() + ttl_s
    while time.monotonic() < deadline:
        time.sleep(min(ttl_s / 10, 2.0, max(0.0, deadline - time.monotonic())))
        latest = read_lease(run)
        if latest is None or latest == seen:
            continue
        if latest.released:
            return latest
        raise LeaseHeldError(
            f"{held} ({run.uri}): {latest.holder} (lease epoch {latest.epoch}) renewed it "
            f"within {ttl_s:.0f} s, so it is alive. Two must never write it. If that process "
            "is gone (its process or pod ended), start this one with --take-over; the old holder "
            "then writes nothing more"
        )
    return seen
