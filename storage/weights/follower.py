"""Following a run's weight versions: the reader side that generators and the evaluator use.

`WeightFollower.advance` moves to the newest intact version, building it in place from the
version held when it lies on the new version's chain (only the deltas are read), otherwise
from the nearest full version and the deltas after it (`WeightStore.build`); versions that
cannot be built are reported in an `Advance`, never raised.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from storage.weights.pieces import Assembled
from storage.weights.versions import WeightIntegrityError, WeightStore, WeightVersionNotFoundError

__all__ = ["Advance", "WeightFollower"]


@dataclass(frozen=True)
class Advance:
    """What `WeightFollower.advance` did: the version now held (None: none intact, nothing
    changed), the versions found corrupt on the way (→ why) and those that vanished. A version
    whose chain passes through a corrupt link is corrupt itself: it can never be built (versions
    are immutable), so a reader skips it for good. A version retention removed while it was
    being read — its own files or any link of its chain — is vanished, never corrupt:
    retention deletes versions newest first (`storage.weights.retention`), so a missing link
    means a missing version."""

    version: int | None
    corrupt: dict[int, str] = field(default_factory=dict)
    vanished: list[int] = field(default_factory=list)


class WeightFollower:
    """Follows a run's weight versions for one consumer (a generator's engine worker, the
    evaluator): `advance` moves to the newest intact version, applying deltas to the version
    held when it can, and `tensors()` gives that version's tensors.

    With `hold=False` nothing is kept between versions (every version is built from its full
    version): use it when the run publishes only full versions (`weights.full_every` = 1).
    Held memory: one copy of the model in the published dtype, on CPU."""

    def __init__(self, store: WeightStore, *, hold: bool = True) -> None:
        self.store, self.hold = store, hold
        self._assembled: Assembled | None = None
        self.version: int | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The held version's tensors (views: valid until the next `advance` or `release`)."""
        if self._assembled is None:
            raise RuntimeError("no weights held: call advance() first")
        return self._assembled.tensors()

    def release(self) -> None:
        """Drop the held tensors unless holding them between versions (`hold`)."""
        if not self.hold:
            self._assembled = None

    def advance(
        self, newer_than: int | None = None, skip: Collection[int] = (), exactly: int | None = None
    ) -> Advance:
        """Build the newest committed version above `newer_than` (default: the held one) and
        not in `skip` whose chain verifies — or `exactly` that version, raising if it cannot be
        built. Versions found corrupt or vanished on the way are reported, not raised: one bad
        publication must not stop the readers of the ones around it."""
        if exactly is not None:
            self._build(exactly)
            return Advance(exactly)
        floor = (self.version or 0) if newer_than is None else newer_than
        corrupt: dict[int, str] = {}
        vanished: list[int] = []
        for version in sorted(self.store.versions(), reverse=True):
            if version <= floor:
                break
            if version in skip:
                continue
            try:
                self._build(version)
            except WeightIntegrityError as exc:
                corrupt[version] = str(exc)
            except WeightVersionNotFoundError:
                vanished.append(version)
            else:
                return Advance(version, corrupt, vanished)
        return Advance(None, corrupt, vanished)

    def _build(self, version: int) -> None:
        onto = self._assembled if self.hold else None
        try:
            self._assembled = self.store.build(version, onto=onto)
        finally:  # a failed build may have moved the held weights to a verified later version
            if self._assembled is not None:
                self.version = self._assembled.version
