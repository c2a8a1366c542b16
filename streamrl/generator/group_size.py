"""How many responses a generator samples for its next prompt: G fixed, or adaptive (eq 27).

The framework guide's adaptive group size (eq 27): short responses are cheap, so a generator
whose responses run short samples more of them per prompt (a finer baseline for the same
compute), one whose responses run long samples fewer:

    G(ℓ) = clamp(⌊G_base · L_ref / ℓ⌋, G_min, G_max)

G_base = `generator.group_size`, L_ref = `generator.adaptive_group.ref_length` (the length at
which G = G_base), ℓ = the generator's running mean response length: an exponential moving
average over the groups it finished,

    ℓ ← ema · ℓ + (1 − ema) · (mean over the group's responses of their sampled tokens),

started at ℓ = L_ref (so before any group G = clamp(G_base, G_min, G_max), and L_ref acts as a
prior whose weight fades as ema^k after k groups). Sampled tokens are those the policy drew
(loss mask 1): a multi-turn response's environment tokens do not count. A mean of 0 (no
sampled token at all, possible only with ema = 0) gives G_max, the formula's limit as ℓ → 0.

Where it departs from the guide: ℓ is per generator and in memory only — a restarted
generator starts again from L_ref — and a group's size is decided when its first turn is
submitted, from the groups finished by then (with several prompts in flight the ones still
sampling are not seen yet).

`FixedGroupSize` is the rule when the option is off: G = G_base always. Both are small and do
no I/O: `size()` for the next prompt, `observe(lengths)` once per finished group
(`EpisodeDriver` calls both).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["AdaptiveGroupSize", "FixedGroupSize", "GroupSizeRule"]


class GroupSizeRule(Protocol):
    """The number of responses of a generator's next group."""

    def size(self) -> int:
        """G for the prompt submitted next."""
        ...

    def observe(self, lengths: Sequence[int]) -> None:
        """A group finished; `lengths`: each response's sampled tokens."""
        ...

    def describe(self) -> str:
        """The rule in one line, for the generator's log."""
        ...


@dataclass(frozen=True)
class FixedGroupSize:
    """G = `group_size` for every prompt (adaptive group size off)."""

    group_size: int

    def size(self) -> int:
        return self.group_size

    def observe(self, lengths: Sequence[int]) -> None:
        pass

    def describe(self) -> str:
        return f"G={self.group_size}"


@dataclass
class AdaptiveGroupSize:
    """G(ℓ) = clamp(⌊base · ref_length / ℓ⌋, min_size, max_size), ℓ an EMA of finished groups'
    mean sampled length (module docstring). `mean_length` is ℓ (starts at `ref_length`),
    `groups_seen` the groups observed."""

    base: int
    ref_length: int
    min_size: int
    max_size: int
    ema: float
    mean_length: float = field(init=False)
    groups_seen: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not 2 <= self.min_size <= self.max_size:
            raise ValueError(
                f"need 2 ≤ min_size ≤ max_size, got {self.min_size} and {self.max_size}"
            )
        if self.base < 1 or self.ref_length <= 0 or not 0.0 <= self.ema < 1.0:
            raise ValueError(
                f"need base ≥ 1, ref_length > 0 and 0 ≤ ema < 1, got {self.base}, "
                f"{self.ref_length} and {self.ema}"
            )
        self.mean_length = float(self.ref_length)

    def size(self) -> int:
        if self.mean_length <= 0.0:  # the formula's limit as ℓ → 0
            return self.max_size
        unclamped = math.floor(self.base * self.ref_length / self.mean_length)
        return min(max(unclamped, self.min_size), self.max_size)

    def observe(self, lengths: Sequence[int]) -> None:
        if not lengths:
            raise ValueError("a finished group has at least one response")
        group_mean = sum(lengths) / len(lengths)  # divided by the group's responses
        self.mean_length = self.ema * self.mean_length + (1.0 - self.ema) * group_mean
        self.groups_seen += 1

    def describe(self) -> str:
        return (
            f"G=clamp(⌊{self.base}·{self.ref_length}/ℓ⌋, {self.min_size}, {self.max_size}) "
            f"(adaptive; ℓ = EMA {self.ema} of finished groups' mean sampled length, "
            f"from {self.ref_length})"
        )
