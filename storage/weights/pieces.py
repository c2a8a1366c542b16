"""Pieces of tensors: how one rank's share of a version is encoded, and how pieces rebuild
tensors (see `storage.weights.manifest` for the format).

`encode_share` turns a rank's pieces into safetensors entries, as deltas against the same
pieces of the base version when a base is given and the delta is smaller; `Assembled` holds
every tensor of one version flattened and applies the next version's pieces to it in place,
verifying each piece's checksum and undoing everything if one fails.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

from storage.weights.manifest import (
    PieceEntry,
    TensorEntry,
    WeightManifest,
    checksum,
    index_dtype,
    piece_key,
)

__all__ = ["Assembled", "EncodedShare", "PieceMismatchError", "TensorShare", "encode_share"]

# Bit patterns are compared, not values: a delta must rebuild the exact bits (−0.0, NaN payloads).
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class PieceMismatchError(ValueError):
    """A piece could not be rebuilt: missing entry, wrong shape, or a checksum mismatch."""


class TensorShare(NamedTuple):
    """One piece of a tensor as a rank holds it: `data` (1-D, CPU, contiguous) are the elements
    `[start, start + len(data))` of the flattened tensor of shape `shape`."""

    data: torch.Tensor
    start: int
    shape: tuple[int, ...]


@dataclass
class EncodedShare:
    """What `encode_share` produced: safetensors entries, the tensor entries of the rank's
    part, and whether any piece is a delta."""

    entries: dict[str, torch.Tensor]
    tensors: dict[str, TensorEntry]
    has_delta: bool

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.entries.values())


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(_SAME_WIDTH_INT[tensor.element_size()])


def _delta(new: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, values) of the elements of `new` whose bits differ from `old`."""
    changed = torch.ne(_bits(new), _bits(old)).nonzero().squeeze(1)
    return changed.to(index_dtype(new.numel())), new[changed]


def encode_share(
    shares: Mapping[str, TensorShare],
    base: Mapping[str, torch.Tensor] | None = None,
    *,
    max_delta_ratio: float = 0.5,
) -> EncodedShare:
    """Encode one rank's pieces; `file` of every piece entry is left empty for the writer.

    With `base` (name → the same piece's data in the base version), a piece is stored as a
    delta when that is smaller than the piece itself; if the share's deltas would still take
    more than `max_delta_ratio` of its full bytes, every piece is stored full (a full version
    costs no more and needs no base).
    """
    sums: dict[str, str] = {}  # each piece's checksum, computed once even if encoded twice
    if base is not None:
        delta = _encode(shares, base, sums)
        full_bytes = sum(s.data.numel() * s.data.element_size() for s in shares.values())
        if delta.nbytes <= max_delta_ratio * full_bytes:
            return delta
    return _encode(shares, None, sums)


def _encode(
    shares: Mapping[str, TensorShare],
    base: Mapping[str, torch.Tensor] | None,
    sums: dict[str, str],
) -> EncodedShare:
    entries: dict[str, torch.Tensor] = {}
    tensors: dict[str, TensorEntry] = {}
    has_delta = False
    for name, share in shares.items():
        data, start = share.data, share.start
        if data.dim() != 1 or data.device.type != "cpu" or not data.is_contiguous():
            raise ValueError(f"the piece of {name!r} must be a 1-D contiguous CPU tensor")
        dtype = str(data.dtype).removeprefix("torch.")
        if data.numel() == 0:  # an empty piece (a rank holding no rows of a small tensor)
            tensors[name] = TensorEntry(dtype, share.shape, ())
            continue
        key = piece_key(name, start)
        encoding = "full"
        old = None if base is None else base.get(name)
        if old is not None:
            if old.shape != data.shape or old.dtype != data.dtype:
                raise ValueError(f"the base piece of {name!r} differs in shape or dtype")
            index, values = _delta(data, old)
            if index.numel() * (index.element_size() + data.element_size()) < data.nbytes:
                entries[f"{key}.index"], entries[f"{key}.values"] = index, values
                encoding, has_delta = "delta", True
        if encoding == "full":
            entries[key] = data
        if name not in sums:
            sums[name] = checksum(data)
        piece = PieceEntry(start, start + data.numel(), "", encoding, sums[name])
        tensors[name] = TensorEntry(dtype, share.shape, (piece,))
    return EncodedShare(entries, tensors, has_delta)


class Assembled:
    """Every tensor of one version, flattened, in the published dtypes (CPU).

    `apply` moves it to the next version: full pieces are verified then copied in, delta
    pieces applied in place and verified. If anything fails, a delta version is undone (the
    held version stays intact); a full version leaves `version` None (nothing usable held).
    """

    def __init__(self, manifest: WeightManifest) -> None:
        self.version: int | None = None
        self.entries = manifest.tensors
        self.flat = {
            name: torch.empty(entry.numel, dtype=entry.torch_dtype)
            for name, entry in self.entries.items()
        }

    def holds(self, manifest: WeightManifest) -> bool:
        """Whether `manifest` has the same tensors (names, dtypes, shapes) as held here."""
        return {n: (e.dtype, e.shape) for n, e in manifest.tensors.items()} == {
            n: (e.dtype, e.shape) for n, e in self.entries.items()
        }

    def tensors(self) -> dict[str, torch.Tensor]:
        """name → the tensor in its shape (views of the held data, not copies)."""
        return {name: self.flat[name].view(entry.shape) for name, entry in self.entries.items()}

    def apply(
        self,
        manifest: WeightManifest,
        batches: Iterable[Mapping[str, Mapping[str, torch.Tensor]]],
    ) -> None:
        """Apply `manifest`'s pieces, read from `batches` of files (each: file → its
        safetensors entries; every file of the manifest once), so only one batch of files is
        in memory at a time.

        A full version may be applied to anything of the same tensors; a delta version only to
        the version it is based on."""
        if manifest.base is not None and manifest.base != self.version:
            raise PieceMismatchError(
                f"version {manifest.version} is a delta against {manifest.base}, but the held "
                f"weights are version {self.version}"
            )
        if not self.holds(manifest):
            raise PieceMismatchError(
                f"version {manifest.version} holds other tensors (names, dtypes or shapes) than "
                f"the held version {self.version}"
            )
        pieces_in: dict[str, list[tuple[str, PieceEntry]]] = defaultdict(list)
        for name, entry in manifest.tensors.items():
            for piece in entry.pieces:
                pieces_in[piece.file].append((name, piece))
        # A full version replaces every piece: a failure leaves no version held, and nothing
        # old is copied to undo it. A delta is undone piece by piece (its few old values).
        replacing = manifest.base is None
        undo: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        try:
            for batch in batches:
                for file, entries in batch.items():
                    for name, piece in pieces_in.pop(file, ()):
                        try:
                            undo.append(self._apply_piece(name, piece, entries, not replacing))
                        except (RuntimeError, IndexError) as exc:  # bad positions or shapes
                            if isinstance(exc, PieceMismatchError):
                                raise
                            raise PieceMismatchError(f"version {manifest.version}: {exc}") from exc
            if pieces_in:
                raise PieceMismatchError(
                    f"version {manifest.version}: files never read: {sorted(pieces_in)}"
                )
        except BaseException:  # also a failed read of the next batch: leave nothing half-done
            if replacing:
                self.version = None
            for target, old, index in reversed(undo if not replacing else []):
                if index is None:
                    target.copy_(old)
                else:
                    target[index] = old
            raise
        self.version = manifest.version

    def _apply_piece(
        self, name: str, piece: PieceEntry, entries: Mapping[str, torch.Tensor], keep_old: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Apply one piece in place; returns what restores it (target, old data, positions;
        for a full piece the old data only when `keep_old`)."""
        target = self.flat[name][piece.start : piece.stop]
        key = piece_key(name, piece.start)
        where = f"{name!r} elements {piece.start}:{piece.stop} in {piece.file}"
        if piece.encoding == "full":
            data = entries.get(key)
            if data is None or data.shape != target.shape or data.dtype != target.dtype:
                raise PieceMismatchError(f"{where}: missing or of the wrong shape or dtype")
            if checksum(data) != piece.checksum:  # verified before it replaces anything
                raise PieceMismatchError(f"{where}: the piece does not match its checksum")
            old = target.clone() if keep_old else target[:0]
            target.copy_(data)
            return target, old, None
        index, values = entries.get(f"{key}.index"), entries.get(f"{key}.values")
        if index is None or values is None or values.dtype != target.dtype:
            raise PieceMismatchError(f"{where}: the delta is missing or of the wrong dtype")
        index = index.long()
        old = target[index]
        target[index] = values
        if checksum(target) != piece.checksum:
            target[index] = old
            raise PieceMismatchError(f"{where}: the rebuilt piece does not match its checksum")
        return target, old, index
