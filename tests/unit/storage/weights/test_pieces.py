"""Pieces of weight versions: `encode_share` (full and delta encodings, bit-exact deltas) and
`Assembled.apply` (rebuilding tensors piece by piece, undoing every piece when one fails),
checked against positions and checksums computed independently with numpy and xxhash."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import pytest
import torch
import xxhash

from storage.weights.manifest import (
    FileEntry,
    PieceEntry,
    TensorEntry,
    WeightManifest,
    index_dtype,
)
from storage.weights.pieces import Assembled, PieceMismatchError, TensorShare, encode_share
from storage.weights.shares import non_finite

FILE = "pieces.safetensors"


def _xxh3(tensor: torch.Tensor) -> str:
    """Reference checksum: xxh3-128 of the raw bytes, through numpy (bf16 as its 16 bits)."""
    raw = tensor.contiguous().view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
    return xxhash.xxh3_128_hexdigest(raw.numpy().tobytes())


def _changed_positions(new: torch.Tensor, old: torch.Tensor) -> list[int]:
    """Reference delta: positions whose bit patterns differ, compared as unsigned integers."""
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[new.element_size()]
    as_bits = [t.view(torch.int16) if t.dtype == torch.bfloat16 else t for t in (new, old)]
    new_bits, old_bits = (t.numpy().view(width) for t in as_bits)
    return np.flatnonzero(new_bits != old_bits).tolist()


def _share(data: torch.Tensor, start: int = 0, shape: tuple[int, ...] | None = None):
    return TensorShare(data, start, (data.numel(),) if shape is None else shape)


def _manifest(version: int, base: int | None, tensors: dict[str, TensorEntry]) -> WeightManifest:
    """A manifest whose pieces all live in FILE (encode_share leaves `file` to the writer)."""
    named = {
        name: TensorEntry(
            entry.dtype,
            entry.shape,
            tuple(PieceEntry(p.start, p.stop, FILE, p.encoding, p.checksum) for p in entry.pieces),
        )
        for name, entry in tensors.items()
    }
    return WeightManifest(
        version=version,
        base=base,
        tensors=named,
        files=(FileEntry(FILE, 1, "0" * 32),),
        model_config={},
        created_at=datetime.now(UTC).isoformat(),
    )


def test_full_encoding_stores_each_piece_under_its_key_with_its_checksum():
    g = torch.Generator().manual_seed(0)
    shares = {
        "w": _share(torch.randn(6, generator=g), start=6, shape=(4, 3)),  # rows 2..3 of 4
        "b": _share(torch.randn(5, generator=g).to(torch.bfloat16)),
        "ids": _share(torch.arange(7, dtype=torch.int64)),
        "none": _share(torch.empty(0), start=3, shape=(1, 3)),  # a rank holding no rows
    }
    encoded = encode_share(shares)

    assert not encoded.has_delta
    assert sorted(encoded.entries) == ["b@0", "ids@0", "w@6"]
    assert encoded.nbytes == 6 * 4 + 5 * 2 + 7 * 8
    assert torch.equal(encoded.entries["w@6"], shares["w"].data)
    assert encoded.tensors["w"] == TensorEntry(
        "float32", (4, 3), (PieceEntry(6, 12, "", "full", _xxh3(shares["w"].data)),)
    )
    assert encoded.tensors["b"].pieces[0].checksum == _xxh3(shares["b"].data)
    assert encoded.tensors["b"].dtype == "bfloat16"
    assert encoded.tensors["none"] == TensorEntry("float32", (1, 3), ())


def test_delta_stores_exactly_the_elements_whose_bits_changed():
    g = torch.Generator().manual_seed(1)
    old = torch.randn(1000, generator=g)
    new = old.clone()
    new[[3, 500, 999]] += 1.0
    new[10] = -0.0 if old[10] != 0 else 1.0
    old[20], new[20] = 0.0, -0.0  # equal as values, different bits
    old_bf16 = torch.randn(64, generator=g).to(torch.bfloat16)
    new_bf16 = old_bf16.clone()
    new_bf16[7] = -new_bf16[7]

    shares = {"w": _share(new, start=1000, shape=(2000,)), "h": _share(new_bf16)}
    encoded = encode_share(shares, {"w": old, "h": old_bf16})

    assert encoded.has_delta
    assert sorted(encoded.entries) == ["h@0.index", "h@0.values", "w@1000.index", "w@1000.values"]
    index = encoded.entries["w@1000.index"]
    assert index.dtype == torch.int32
    assert index.tolist() == _changed_positions(new, old) == [3, 10, 20, 500, 999]
    assert torch.equal(encoded.entries["w@1000.values"], new[index.long()])
    assert torch.signbit(encoded.entries["w@1000.values"][2])  # -0.0 stored as -0.0
    assert encoded.entries["h@0.index"].tolist() == _changed_positions(new_bf16, old_bf16) == [7]
    (piece,) = encoded.tensors["w"].pieces
    assert (piece.start, piece.stop, piece.encoding) == (1000, 2000, "delta")
    assert piece.checksum == _xxh3(new)  # the full content, not the delta's
    assert encoded.nbytes == 5 * (4 + 4) + 1 * (4 + 2)


def test_nan_payloads_are_kept_bit_for_bit():
    """NaNs never compare equal as values: a delta compares bits, so a NaN whose payload did
    not change is not stored, and one whose payload did is rebuilt exactly."""
    bits = torch.zeros(8, dtype=torch.int32)
    bits[1] = 0x7FC00001  # a NaN with payload 1
    bits[2] = 0x7FC00002
    old = bits.view(torch.float32).clone()
    new_bits = bits.clone()
    new_bits[2] = 0x7FC00003  # same NaN-ness, another payload
    new = new_bits.view(torch.float32).clone()

    encoded = encode_share({"w": _share(new)}, {"w": old})
    assert encoded.entries["w@0.index"].tolist() == [2]

    held = Assembled(_manifest(1, None, encode_share({"w": _share(old)}).tensors))
    held.apply(_manifest(1, None, encode_share({"w": _share(old)}).tensors), [{FILE: {"w@0": old}}])
    held.apply(_manifest(2, 1, encoded.tensors), [{FILE: encoded.entries}])
    assert torch.equal(held.tensors()["w"].view(torch.int32), new_bits)


def test_a_piece_is_stored_full_when_its_delta_would_not_be_smaller():
    old = torch.zeros(100)
    mostly_changed = torch.arange(100, dtype=torch.float32)  # 99 changes: 792 bytes > 400
    one_changed = old.clone()
    one_changed[5] = 1.0
    shares = {"a": _share(mostly_changed), "b": _share(torch.cat([one_changed] * 10))}
    encoded = encode_share(shares, {"a": old, "b": torch.zeros(1000)})
    assert [encoded.tensors[n].pieces[0].encoding for n in "ab"] == ["full", "delta"]
    assert sorted(encoded.entries) == ["a@0", "b@0.index", "b@0.values"]

    # A piece without a base piece (a tensor new in this version) is stored full.
    assert encode_share({"c": _share(old)}, {}).tensors["c"].pieces[0].encoding == "full"


@pytest.mark.parametrize(("ratio", "delta"), [(0.5, False), (0.9, True)])
def test_a_share_whose_deltas_exceed_max_delta_ratio_is_stored_full(ratio, delta):
    old = torch.zeros(1000)
    new = old.clone()
    new[:300] = 1.0  # 300 * 8 bytes = 2400 of 4000: 60 %
    encoded = encode_share({"w": _share(new)}, {"w": old}, max_delta_ratio=ratio)
    assert encoded.has_delta is delta
    assert encoded.tensors["w"].pieces[0].encoding == ("delta" if delta else "full")


def test_unchanged_piece_is_an_empty_delta():
    old = torch.randn(50)
    encoded = encode_share({"w": _share(old.clone())}, {"w": old})
    assert encoded.has_delta
    assert encoded.nbytes == 0
    assert encoded.entries["w@0.index"].numel() == 0


def test_index_dtype_widens_for_huge_pieces():
    assert index_dtype(2**31 - 1) == torch.int32
    assert index_dtype(2**31) == torch.int64


@pytest.mark.parametrize(
    ("data", "base", "match"),
    [
        (torch.zeros(2, 2), None, "1-D contiguous CPU tensor"),
        (torch.zeros(8)[::2], None, "1-D contiguous CPU tensor"),
        (torch.zeros(4), torch.zeros(5), "differs in shape or dtype"),
        (torch.zeros(4), torch.zeros(4, dtype=torch.float64), "differs in shape or dtype"),
    ],
)
def test_bad_pieces_are_refused(data, base, match):
    with pytest.raises(ValueError, match=match):
        encode_share({"w": TensorShare(data, 0, (8,))}, None if base is None else {"w": base})


def _two_tensor_versions():
    """Version 1 full and version 2 a delta on it, of tensors `a` (two pieces) and `b`."""
    g = torch.Generator().manual_seed(2)
    a1, b1 = torch.randn(10, generator=g), torch.randn(4, generator=g).to(torch.bfloat16)
    a2, b2 = a1.clone(), b1.clone()
    a2[[1, 8]] = 7.0
    b2[:] = 3.0
    pieces_1 = [{"a": _share(a1[:6], 0, (10,)), "b": _share(b1)}, {"a": _share(a1[6:], 6, (10,))}]
    pieces_2 = [{"a": _share(a2[:6], 0, (10,)), "b": _share(b2)}, {"a": _share(a2[6:], 6, (10,))}]
    bases = [{"a": a1[:6], "b": b1}, {"a": a1[6:]}]
    v1 = [encode_share(p) for p in pieces_1]
    v2 = [encode_share(p, base) for p, base in zip(pieces_2, bases, strict=True)]

    def manifest(version, base, ranks):
        tensors = dict(ranks[0].tensors)
        tensors["a"] = tensors["a"].merged(ranks[1].tensors["a"])
        entries = {**ranks[0].entries, **ranks[1].entries}
        return _manifest(version, base, tensors), {FILE: entries}

    return manifest(1, None, v1), manifest(2, 1, v2), {"a": a2, "b": b2}


def test_assembled_rebuilds_a_version_from_pieces_and_deltas():
    (m1, blobs1), (m2, blobs2), want = _two_tensor_versions()
    assert [p.encoding for p in m2.tensors["a"].pieces] == ["delta", "delta"]
    assert [p.encoding for p in m2.tensors["b"].pieces] == ["full"]  # every element changed
    held = Assembled(m1)
    held.apply(m1, [blobs1])
    held.apply(m2, [blobs2])
    assert held.version == 2
    for name, tensor in want.items():
        assert torch.equal(held.tensors()[name], tensor)
        assert held.tensors()[name].dtype == tensor.dtype


def test_a_failing_piece_restores_every_piece_the_apply_changed():
    (m1, blobs1), (m2, blobs2), _ = _two_tensor_versions()
    held = Assembled(m1)
    held.apply(m1, [blobs1])
    before = {name: t.clone() for name, t in held.tensors().items()}

    # The last piece applied (`b`, full, after both delta pieces of `a`) fails its checksum.
    bad_b = TensorEntry("bfloat16", (4,), (PieceEntry(0, 4, FILE, "full", "f" * 32),))
    bad = _manifest(2, 1, {"a": m2.tensors["a"], "b": bad_b})
    with pytest.raises(PieceMismatchError, match=r"'b' elements 0:4 .* does not match"):
        held.apply(bad, [blobs2])
    _assert_held(held, before, version=1)

    # A delta whose positions run past the piece: an IndexError, undone the same way.
    broken = dict(blobs2[FILE])
    broken["a@6.index"] = torch.tensor([0, 99], dtype=torch.int32)
    broken["a@6.values"] = torch.ones(2)
    with pytest.raises(PieceMismatchError, match="version 2"):
        held.apply(m2, [{FILE: broken}])
    _assert_held(held, before, version=1)

    # A missing entry.
    with pytest.raises(PieceMismatchError, match="delta is missing"):
        held.apply(m2, [{FILE: {k: v for k, v in blobs2[FILE].items() if k != "a@6.values"}}])
    _assert_held(held, before, version=1)

    held.apply(m2, [blobs2])  # the good version still applies
    assert held.version == 2


def test_a_failed_read_of_a_later_batch_restores_what_earlier_batches_changed():
    (m1, blobs1), (m2, blobs2), _ = _two_tensor_versions()
    held = Assembled(m1)
    held.apply(m1, [blobs1])
    before = {name: t.clone() for name, t in held.tensors().items()}

    def batches():
        yield blobs2  # every piece applied and verified...
        raise OSError("the next batch of files could not be read")  # ...then the read fails

    with pytest.raises(OSError, match="could not be read"):
        held.apply(m2, batches())
    _assert_held(held, before, version=1)
    with pytest.raises(PieceMismatchError, match="files never read"):
        held.apply(m2, [{}])
    _assert_held(held, before, version=1)


def _assert_held(held: Assembled, before: dict[str, torch.Tensor], version: int) -> None:
    assert held.version == version
    for name, tensor in before.items():  # bits compared: 1-D tensors viewed as bytes
        assert torch.equal(held.tensors()[name].view(torch.uint8), tensor.view(torch.uint8))


def test_a_delta_applies_only_to_its_base_and_tensors_must_match():
    (m1, blobs1), (m2, blobs2), _ = _two_tensor_versions()
    held = Assembled(m1)
    with pytest.raises(PieceMismatchError, match="delta against 1, but the held weights are"):
        held.apply(m2, [blobs2])  # nothing held yet
    held.apply(m1, [blobs1])
    other = _manifest(3, None, encode_share({"a": _share(torch.zeros(10))}).tensors)
    with pytest.raises(PieceMismatchError, match="holds other tensors"):
        held.apply(other, [{FILE: {"a@0": torch.zeros(10)}}])
    assert held.version == 1


def test_a_failing_full_version_leaves_no_version_held_and_the_next_full_one_applies():
    (m1, blobs1), _, _ = _two_tensor_versions()
    held = Assembled(m1)
    held.apply(m1, [blobs1])
    bad_b = TensorEntry("bfloat16", (4,), (PieceEntry(0, 4, FILE, "full", "f" * 32),))
    broken = _manifest(3, None, {"a": m1.tensors["a"], "b": bad_b})
    with pytest.raises(PieceMismatchError, match=r"'b' elements 0:4 .* does not match"):
        held.apply(broken, [blobs1])
    assert held.version is None  # partly replaced: nothing usable is held
    held.apply(m1, [blobs1])
    assert held.version == 1


def test_non_finite_names_every_tensor_with_nan_or_inf_in_any_dtype():
    clean = torch.randn(64)
    tensors = {"clean": clean, "ints": torch.arange(5), "empty": torch.zeros(0)}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for bad in (float("nan"), float("inf"), float("-inf")):
            poisoned = clean.clone().to(dtype)
            poisoned[37] = bad
            tensors[f"{dtype}-{bad}"] = poisoned
    found = non_finite(tensors)
    assert found == [name for name in tensors if "-" in name]
    assert len(found) == 9
    assert non_finite({"clean": clean}) == []
