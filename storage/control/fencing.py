"""The fence a writer checks right before a write that a second writer could clobber.

`storage.control.lease.RunLease` is the learner's: `check()` returns the epoch it holds or raises
`LeaseLostError`. Stores that take one (`CheckpointStore`, `release_consumed`) call it right
before each such write and record the epoch where the write has a record (COMMITTED).
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["Fence"]


class Fence(Protocol):
    def check(self) -> int:
        """The epoch this writer holds; raises when it holds none any more (write nothing)."""
        ...
