"""A generator's index: which of the run's generators a process is.

- `reserve_generator_indexes`, `claim_generator_index`: the run's own generator indexes
  (`<run>/control/generators/<i>.json`, created once, never released), and the next free one
  for a generator that joins later (scaling out). Supervisors call these.
- `hold_generator_index`: the index a generator process runs as, held by it alone while it
  lives (a lease under `<run>/generators/gen<i>/`, `storage.control.lease`).
"""

from __future__ import annotations

import json
import time
import uuid

from storage.control.lease import LeaseHeldError, LeaseLostError, RunLease
from storage.fs import Location, create_once

__all__ = [
    "GENERATOR_LEASE_TTL_S",
    "GeneratorIndex",
    "GeneratorIndexHeldError",
    "GeneratorIndexLostError",
    "claim_generator_index",
    "hold_generator_index",
    "reserve_generator_indexes",
]


def reserve_generator_indexes(run: Location, count: int, owner: str = "") -> None:
    """Mark indexes 0..count−1 as taken (the run's own generators); existing marks stay."""
    for index in range(count):
        _claim(run, index, owner)


def claim_generator_index(run: Location, *, first: int = 0, owner: str = "") -> int:
    """Claim the lowest free generator index ≥ `first` for a generator joining `run`: an
    object `<run>/control/generators/<index>.json` created if absent, so two generators
    joining at once never get the same index. Claims are never released (an index names a
    writer whose segments are in the stream)."""
    folder = run.child("control", "generators")
    taken = set()
    if folder.fs.exists(folder.path):
        taken = {
            int(name.rsplit("/", 1)[-1].removesuffix(".json"))
            for name in folder.fs.ls(folder.path, detail=False)
            if name.endswith(".json")
        }
    index = first
    while True:
        if index not in taken and _claim(run, index, owner):
            return index
        index += 1


def _claim(run: Location, index: int, owner: str) -> bool:
    """Create index `index`'s claim record unless it exists; True if this call created it (a
    retried request of its own included: the record carries a nonce and is read back)."""
    folder = run.child("control", "generators")
    record = {"index": index, "owner": owner, "at": time.time(), "nonce": uuid.uuid4().hex}
    return create_once(folder.fs, folder.join(f"{index}.json"), json.dumps(record).encode())


# -- the index a generator process runs as ---------------------------------------------------

GENERATOR_LEASE_TTL_S = 30.0


class GeneratorIndexHeldError(RuntimeError):
    """Another live generator holds the index; the message names it and what to do."""


class GeneratorIndexLostError(RuntimeError):
    """This generator's index was taken over: it must commit nothing more."""


class GeneratorIndex:
    """Generator `index` of a run, held by this process (`hold_generator_index`) until
    `release()` (also as a context manager). `check()` guards every commit."""

    def __init__(self, index: int, lease: RunLease) -> None:
        self.index, self.lease = index, lease

    def check(self) -> None:
        """Raises `GeneratorIndexLostError` when another generator took the index over, or
        this one's renewals lapsed (stopped, or cut off from storage) so that one may have."""
        try:
            self.lease.check()
        except LeaseLostError as exc:
            raise GeneratorIndexLostError(
                f"generator {self.index} no longer holds its index, so it commits nothing "
                f"more ({exc})"
            ) from exc

    def release(self) -> None:
        self.lease.release()

    def __enter__(self) -> GeneratorIndex:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def hold_generator_index(
    run: Location, index: int, *, take_over: bool = False, ttl_s: float = GENERATOR_LEASE_TTL_S
) -> GeneratorIndex:
    """Hold generator `index` of `run` for this process: an explicit index, or one claimed for
    it (`claim_generator_index`), goes through the same steps.

    1. The index is claimed as a joining generator's would be (its claim record is created if
       absent), so `claim_generator_index` never hands it out afterwards.
    2. Its lease — `storage.control.lease` on `<run>/generators/gen<index>/`: an epoch record that
       the holder renews every `ttl_s`/3 and releases when it ends — is taken. If another process
       holds it, this one watches the record for up to `ttl_s` on its own clock: renewed, the
       holder is alive and this refuses; not renewed, it lapsed and this takes it. `take_over`
       takes it at once: for a supervisor restarting the index, which saw the previous process
       end.

    Raises:
        GeneratorIndexHeldError: a live generator holds the index (the message names it).
    """
    if index < 0:
        raise ValueError(f"generator index must be ≥ 0, got {index}")
    _claim(run, index, owner=f"streamrl generator --index {index}")
    where = run.child("generators", f"gen{index}")
    kind = ("generator", f"generator index {index} of run {run.uri}")
    try:
        lease = RunLease.acquire(where, ttl_s=ttl_s, take_over=take_over, kind=kind)
    except LeaseHeldError as exc:
        raise GeneratorIndexHeldError(f"{exc}. {_HELD_ADVICE}") from exc
    return GeneratorIndex(index, lease)


_HELD_ADVICE = (
    "Two generators must never run one index (they would generate its data shard twice): stop "
    "that generator first, or start this one with another --index; if that process has ended "
    "(its machine is gone), its lease lapses by itself, or pass --take-over"
)
