"""The weight store: the learner publishes policy versions, generators load them.

Layout under `<run>/weights/`:

    v<version:08d>/<publish>-r<rank>-<i>.safetensors    pieces written by learner rank <rank>
    v<version:08d>/<publish>-part-<rank>-of-<world>.json    `SharePart`: what that rank wrote,
                                    written after its files (or the error that stopped it)
    v<version:08d>/manifest.json    `WeightManifest` (storage.weight_manifest): every tensor, its
                                    pieces and their files, checksums; written LAST by rank 0,
                                    create-if-absent, once every rank's part is there
    LATEST                          {"version": N}; written after the manifest, the only object
                                    ever overwritten (atomic rename locally, one PUT on S3)

`<publish>` is one id per publishing learner life, so a dead life's leftovers in a folder are
never mistaken for this one's. No host holds the whole model: each rank writes its own pieces
(`write_share`); rank 0 then `commit`s. A version exists exactly when its manifest does: a
publish killed before `commit` leaves a folder no reader lists or opens, deleted by `retain`
once a newer version is committed. Versions are immutable; publishing one that has a manifest
fails; NaN or inf is refused before anything is written.

Whatever no committed manifest names is garbage that `retain` deletes: retired versions, dead
publishes' folders, and in a kept version the part records and the files of a publish that
died before the one that committed it (readers open only what the manifest names, and a
manifest never changes, so deleting the rest cannot hurt one).

A version is *full* or a *delta* against the previous version (`manifest.base`). Readers build
a version from the nearest full version and the deltas after it (`WeightFollower`), verifying
every file and every rebuilt piece; `retain` never deletes a version that a kept delta needs,
and deletes retired versions newest first (each one's manifest before its files): a reader
that finds a link of its chain gone also finds the version it builds gone, so a version removed
under it reads as vanished (`WeightVersionNotFoundError`), never as corrupt
(`WeightIntegrityError`, which readers skip for good).

Fencing: with a `fence` (the learner's lease, `storage.fencing.Fence`), `fence.check()` runs
right before every write another learner could clobber — the manifest, LATEST, each deletion
of `retain` — and what it raises (the lease was lost) stops the write; the manifest records
the epoch it returned.
"""

from __future__ import annotations

import json
import posixpath
import re
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch

from storage.fs import Location, StorageError, put_if_absent, replace_object
from storage.weight_manifest import (
    FileEntry,
    PieceEntry,
    SharePart,
    TensorEntry,
    WeightManifest,
    checksum,
    piece_key,
)
from storage.weight_pieces import Assembled, PieceMismatchError, TensorShare, encode_share
from storage.weight_shares import check_finite, new_publish_id, whole_shares

if TYPE_CHECKING:
    from storage.fencing import Fence

__all__ = [
    "PublishAbandonedError",
    "WeightIntegrityError",
    "WeightManifest",
    "WeightStore",
    "WeightVersionExistsError",
    "WeightVersionNotFoundError",
]

MANIFEST_NAME = "manifest.json"
LATEST_NAME = "LATEST"
DEFAULT_SHARD_BYTES = 512 * 1024**2
_IO_BATCH_BYTES = 512 * 1024**2  # serialised bytes per batch of concurrent PUTs / GETs
_VERSION_DIR = re.compile(r"v(\d{8,})")
_FILE_SUFFIX = ".safetensors"
_DATA_FILE = re.compile(r"(?P<publish>.+)-r\d{5,}-\d{5,}" + re.escape(_FILE_SUFFIX))


class WeightIntegrityError(StorageError):
    """A stored object does not match what its manifest (or format) promises."""


class WeightVersionExistsError(StorageError):
    """The version was already committed; versions are immutable."""


class WeightVersionNotFoundError(StorageError):
    """The version has no manifest (never committed, dead publish, or removed by `retain`)."""


class PublishAbandonedError(StorageError):
    """A rank could not write its share of a version (its part names the error), or not in
    time: the version was not committed and LATEST did not move."""


def _check_int(value: object, minimum: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value!r}")


def _part_name(publish_id: str, rank: int, world: int) -> str:
    return f"{publish_id}-part-{rank:05d}-of-{world:05d}.json"


def _batches(items: list[tuple[str, int]], limit: int) -> Iterator[list[str]]:
    """Names grouped so each group's sizes add up to about `limit` (one item at least)."""
    batch: list[str] = []
    size = 0
    for name, nbytes in items:
        if batch and size + nbytes > limit:
            yield batch
            batch, size = [], 0
        batch.append(name)
        size += nbytes
    if batch:
        yield batch


class WeightStore:
    """Versions of one run's policy weights under `<run>/weights/` (see module docstring).

    `fence`: checked right before the manifest is written, LATEST moves or `retain` deletes
    anything (None: the writer holds no lease, as readers and single-process tools)."""

    def __init__(self, location: Location, fence: Fence | None = None) -> None:
        self.root = location.child("weights")
        self.fs = location.fs
        self.fence = fence

    def _check_fence(self) -> int | None:
        """The epoch the fence holds (None without a fence); what it raises propagates."""
        return None if self.fence is None else self.fence.check()

    def _path(self, version: int, *name: str) -> str:
        """The folder of `version`, or the object `name` in it."""
        return self.root.join(f"v{version:08d}", *name)

    # -- writing -------------------------------------------------------------------------

    def publish(
        self,
        version: int,
        state_dict: Mapping[str, torch.Tensor],
        *,
        model_config: dict[str, Any] | None = None,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        base: tuple[int, Mapping[str, torch.Tensor]] | None = None,
        max_delta_ratio: float = 0.5,
    ) -> WeightManifest:
        """Store a whole `state_dict` as `version` from one process: `write_share` as the only
        rank, then `commit`. `base` = (version, its state dict) allows a delta against it."""
        config = _json_object(model_config)  # a bad config fails before any upload
        if not state_dict:
            raise ValueError("state_dict is empty: nothing to publish")
        shares = whole_shares(state_dict)
        base_pieces = None
        if base is not None:
            base_pieces = {name: share.data for name, share in whole_shares(base[1]).items()}
        publish_id = new_publish_id()
        self.write_share(
            version,
            shares,
            publish_id=publish_id,
            rank=0,
            world=1,
            base=None if base is None else (base[0], base_pieces),
            shard_bytes=shard_bytes,
            max_delta_ratio=max_delta_ratio,
        )
        return self.commit(version, publish_id=publish_id, world=1, model_config=config)

    def write_share(
        self,
        version: int,
        shares: Mapping[str, TensorShare],
        *,
        publish_id: str,
        rank: int,
        world: int,
        base: tuple[int, Mapping[str, torch.Tensor]] | None = None,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        max_delta_ratio: float = 0.5,
    ) -> SharePart:
        """Upload rank `rank`'s pieces of `version`, then its part record; invisible to readers
        until `commit`. Every rank of the publish passes the same tensor names (a rank holding
        no elements of a tensor passes an empty piece). With `base` = (version, name → the same
        pieces' data in that version) pieces may be stored as deltas (`encode_share`).
        Raises `WeightVersionExistsError` if `version` is committed."""
        _check_int(version, 1, "weight version")
        _check_int(shard_bytes, 1, "shard_bytes")
        if not shares:
            raise ValueError("no tensors to publish")
        check_finite(version, {name: share.data for name, share in shares.items()})
        if self.fs.exists(self._path(version, MANIFEST_NAME)):
            raise self._exists_error(version)
        if base is not None and not 0 < base[0] < version:
            raise ValueError(f"base version {base[0]} must be in [1, {version})")
        encoded = encode_share(
            shares, None if base is None else base[1], max_delta_ratio=max_delta_ratio
        )
        if self.root.is_local:
            self.fs.makedirs(self._path(version), exist_ok=True)
        # A delta piece's `.index` and `.values` must land in one file (the piece names one):
        # files are filled piece by piece, never entry by entry.
        keys_of: dict[str, list[str]] = {}
        for key in encoded.entries:
            keys_of.setdefault(_piece_of_key(key), []).append(key)
        sizes = [
            (piece, sum(encoded.entries[k].nbytes for k in keys)) for piece, keys in keys_of.items()
        ]
        file_of: dict[str, str] = {}
        files: list[FileEntry] = []
        pending: dict[str, bytes] = {}
        # One batch uploads while the next is serialised: at most two batches in memory.
        with ThreadPoolExecutor(1, thread_name_prefix="weight-upload") as uploader:
            uploading: Future[None] | None = None
            for index, pieces in enumerate(_batches(sizes, shard_bytes), start=1):
                file = f"{publish_id}-r{rank:05d}-{index:05d}{_FILE_SUFFIX}"
                keys = [key for piece in pieces for key in keys_of[piece]]
                data = safetensors.torch.save({key: encoded.entries[key] for key in keys})
                files.append(FileEntry(file, len(data), checksum(data)))
                file_of.update((key, file) for key in keys)
                pending[self._path(version, file)] = data
                if sum(map(len, pending.values())) >= _IO_BATCH_BYTES:
                    if uploading is not None:
                        uploading.result()
                    uploading = uploader.submit(self.fs.pipe, pending)  # concurrent PUTs on S3
                    pending = {}
            if uploading is not None:
                uploading.result()
            if pending:
                self.fs.pipe(pending)
        tensors = {
            name: TensorEntry(
                entry.dtype,
                entry.shape,
                tuple(
                    PieceEntry(
                        p.start, p.stop, file_of[_first_key(name, p)], p.encoding, p.checksum
                    )
                    for p in entry.pieces
                ),
            )
            for name, entry in encoded.tensors.items()
        }
        part = SharePart(
            rank,
            world,
            tuple(files),
            tensors,
            base=base[0] if base is not None and encoded.has_delta else None,
        )
        replace_object(self.root, self._path(version, _part_name(publish_id, rank, world)),
                       part.to_json().encode())  # fmt: skip
        return part

    def abandon_share(
        self, version: int, *, publish_id: str, rank: int, world: int, error: str
    ) -> None:
        """Record that rank `rank` could not write its share: `commit` stops waiting as soon as
        it reads this, whatever the other ranks do."""
        part = SharePart(rank, world, error=error)
        replace_object(self.root, self._path(version, _part_name(publish_id, rank, world)),
                       part.to_json().encode())  # fmt: skip

    def commit(
        self,
        version: int,
        *,
        publish_id: str,
        world: int,
        model_config: dict[str, Any] | None = None,
        timeout_s: float = 600.0,
    ) -> WeightManifest:
        """Wait for the part of every rank of `publish_id`, check their files are all there,
        write the manifest (create-if-absent), then point LATEST at `version`.

        Idempotent for one publish: if `publish_id` already wrote the manifest (an earlier
        attempt failed after it, e.g. moving LATEST), this only moves LATEST and returns it.
        Raises `PublishAbandonedError` if a rank recorded an error or a part is still missing
        after `timeout_s` (nothing committed, LATEST unchanged), `WeightVersionExistsError` if
        another publish committed `version`, and whatever the fence raises (the manifest not
        written, or LATEST not moved)."""
        manifest = self._committed_by(version, publish_id)
        if manifest is None:
            manifest = self._write_manifest(version, publish_id, world, model_config, timeout_s)
        self._check_fence()
        # Readers must never see a half-written LATEST.
        replace_object(
            self.root, self.root.join(LATEST_NAME), json.dumps({"version": version}).encode()
        )
        return manifest

    def _write_manifest(
        self,
        version: int,
        publish_id: str,
        world: int,
        model_config: dict[str, Any] | None,
        timeout_s: float,
    ) -> WeightManifest:
        """The manifest of every rank's part of `publish_id`, stored create-if-absent."""
        parts = self._wait_for_parts(version, publish_id, world, timeout_s)
        tensors: dict[str, TensorEntry] = {}
        for part in parts:
            for name, entry in part.tensors.items():
                tensors[name] = tensors[name].merged(entry) if name in tensors else entry
        bases = {part.base for part in parts if part.base is not None}
        if len(bases) > 1:
            raise PublishAbandonedError(f"version {version}: ranks used different bases {bases}")
        files = tuple(f for part in parts for f in part.files)
        listing = self._listing(version)
        for entry in files:
            if listing.get(entry.file) != entry.size:
                raise WeightIntegrityError(
                    f"cannot commit version {version}: {entry.file} is missing or not "
                    f"{entry.size} bytes"
                )
        manifest = WeightManifest(
            version=version,
            base=bases.pop() if bases else None,
            tensors=tensors,
            files=files,
            model_config=_json_object(model_config),
            created_at=datetime.now(UTC).isoformat(),
            epoch=self._check_fence(),
        )
        if put_if_absent(self.fs, self._path(version, MANIFEST_NAME), manifest.to_json().encode()):
            return manifest
        # The name is taken: by this very request if a retried PUT had landed, else by
        # another publish (raises).
        stored = self._committed_by(version, publish_id)
        if stored is None:
            raise StorageError(
                f"{self.root.uri}: the manifest of version {version} was refused as existing "
                "but cannot be read; is the store honouring If-None-Match?"
            )
        return stored

    def _committed_by(self, version: int, publish_id: str) -> WeightManifest | None:
        """The manifest of `version` if `publish_id` wrote it (every file it names is one of
        that publish's); None if `version` has none; `WeightVersionExistsError` if another
        publish committed it."""
        try:
            manifest = self.read_manifest(version)
        except WeightVersionNotFoundError:
            return None
        if manifest.files and all(_publish_of(f.file) == publish_id for f in manifest.files):
            return manifest
        raise self._exists_error(version)

    def _listing(self, version: int) -> dict[str, int]:
        """Object name → size in the folder of `version` (one listing)."""
        try:
            entries = self.fs.ls(self._path(version), detail=True)
        except FileNotFoundError:
            return {}
        return {posixpath.basename(e["name"]): e["size"] for e in entries}

    def _wait_for_parts(
        self, version: int, publish_id: str, world: int, timeout_s: float
    ) -> list[SharePart]:
        """Every rank's part, read as each appears; the first one recording an error, or the
        deadline, ends the wait with `PublishAbandonedError`."""
        paths = [self._path(version, _part_name(publish_id, r, world)) for r in range(world)]
        parts: dict[str, SharePart] = {}
        deadline = time.monotonic() + timeout_s
        pause = 0.02
        while True:
            present = self._listing(version)
            new = [p for p in paths if p not in parts and posixpath.basename(p) in present]
            if new:
                blobs = self.fs.cat(new)
                parts.update((path, SharePart.from_json(blobs[path])) for path in new)
            failed = [f"rank {p.rank}: {p.error}" for p in parts.values() if p.error is not None]
            if failed:
                raise PublishAbandonedError(
                    f"version {version} not committed, a rank could not write its share "
                    f"({'; '.join(failed)}); LATEST is unchanged"
                )
            if len(parts) == world:
                return [parts[path] for path in paths]
            if time.monotonic() > deadline:
                missing = [posixpath.basename(p) for p in paths if p not in parts]
                raise PublishAbandonedError(
                    f"version {version} not committed: no part from {len(missing)} rank(s) "
                    f"after {timeout_s:.0f}s ({', '.join(missing[:3])}); LATEST is unchanged"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.5)

    # -- reading -------------------------------------------------------------------------

    def _scan(self) -> dict[int, set[str]]:
        """Every version folder → the names of the objects in it (one listing)."""
        folders: dict[int, set[str]] = {}
        prefix = self.root.path.rstrip("/") + "/"
        for path in self.fs.find(self.root.path, withdirs=True):
            parts = path.removeprefix(prefix).strip("/").split("/")
            if match := _VERSION_DIR.fullmatch(parts[0]):
                names = folders.setdefault(int(match[1]), set())
                names.update(parts[1:2] if len(parts) == 2 else ())
        return folders

    def _read_latest(self) -> int | None:
        """The version LATEST names, whether or not its manifest exists; None if no LATEST."""
        try:
            data = self.fs.cat_file(self.root.join(LATEST_NAME))
        except FileNotFoundError:
            return None
        try:
            version = json.loads(data)["version"]
            _check_int(version, 1, "version")
        except (ValueError, KeyError, TypeError):
            raise WeightIntegrityError(
                f"{self.root.uri}/LATEST is malformed: {data[:80]!r}"
            ) from None
        return version

    def versions(self) -> list[int]:
        """Committed versions (those with a manifest), ascending."""
        return sorted(v for v, names in self._scan().items() if MANIFEST_NAME in names)

    def latest_version(self) -> int | None:
        """The version LATEST names if its manifest exists, else the newest committed version
        (the publisher died between manifest and LATEST, or the version was deleted); None if
        nothing is committed."""
        named = self._read_latest()
        if named is not None and self.fs.exists(self._path(named, MANIFEST_NAME)):
            return named
        return max(self.versions(), default=None)

    def read_manifest(self, version: int) -> WeightManifest:
        """The validated manifest of `version`; `WeightVersionNotFoundError` if it has none."""
        _check_int(version, 1, "weight version")
        try:
            text = self.fs.cat_file(self._path(version, MANIFEST_NAME))
        except FileNotFoundError:
            raise WeightVersionNotFoundError(
                f"weight version {version} has no manifest under {self.root.uri}; "
                f"available versions: {self.versions() or 'none'}"
            ) from None
        try:
            manifest = WeightManifest.from_json(text)
        except ValueError as exc:
            raise WeightIntegrityError(f"manifest of version {version} is invalid: {exc}") from exc
        if manifest.version != version:
            raise WeightIntegrityError(f"manifest of v{version:08d} says {manifest.version}")
        return manifest

    def chain(self, version: int) -> list[WeightManifest]:
        """The manifests needed to build `version`: its nearest full version, then every delta
        after it up to `version` (oldest first). A missing link raises
        `WeightIntegrityError` (or `WeightVersionNotFoundError` if `version` itself is gone)."""
        chain = [self.read_manifest(version)]
        while (base := chain[-1].base) is not None:
            try:
                chain.append(self.read_manifest(base))
            except WeightVersionNotFoundError:
                if not self.fs.exists(self._path(version, MANIFEST_NAME)):
                    raise  # the whole chain went: retention removed it while we read
                raise WeightIntegrityError(
                    f"weight version {version} cannot be built: version {base}, which "
                    f"{chain[-1].version} is a delta against, has no manifest"
                ) from None
            if chain[-1].version != base:
                raise WeightIntegrityError(f"manifest of v{base:08d} is not version {base}")
        return chain[::-1]

    def read_pieces(self, manifest: WeightManifest) -> Iterator[dict[str, dict[str, torch.Tensor]]]:
        """The files of `manifest`, verified and deserialised, a batch of about 1 GiB at a time
        (file → its safetensors entries); concurrent GETs within a batch on S3."""
        version = manifest.version
        sizes = [(entry.file, entry.size) for entry in manifest.files]
        entries = {entry.file: entry for entry in manifest.files}
        for batch in _batches(sizes, _IO_BATCH_BYTES):
            paths = {self._path(version, file): file for file in batch}
            try:
                blobs = self.fs.cat(list(paths))
            except FileNotFoundError as exc:
                raise self._vanished_error(version, exc) from exc
            loaded: dict[str, dict[str, torch.Tensor]] = {}
            for path, file in paths.items():
                data = blobs.pop(path)
                expected = entries[file]
                if len(data) != expected.size or checksum(data) != expected.checksum:
                    raise WeightIntegrityError(
                        f"weight version {version} file {file} is corrupt: expected "
                        f"{expected.size} bytes with checksum {expected.checksum}, got "
                        f"{len(data)} bytes with {checksum(data)}"
                    )
                try:
                    loaded[file] = safetensors.torch.load(data)
                except Exception as exc:  # a checksum-clean file that does not parse
                    raise WeightIntegrityError(
                        f"weight version {version} file {file} does not parse: {exc}"
                    ) from exc
            yield loaded

    def build(self, version: int, onto: Assembled | None = None) -> Assembled:
        """`version` assembled: from `onto` (a held earlier version) when it lies on the
        version's chain, applying the deltas after it in place; otherwise (or if that fails)
        from the nearest full version, into `onto`'s memory when the tensors match (one copy
        of the model, never two). Every file and rebuilt piece is verified; a failure leaves
        `onto` at a verified version (possibly one further along the chain)."""
        chain = self.chain(version)
        held = [m.version for m in chain]
        if onto is not None and onto.version in held:
            try:
                for manifest in chain[held.index(onto.version) + 1 :]:
                    self._apply(onto, manifest)
                return onto
            except WeightIntegrityError:
                pass  # onto is at a verified version: start over from the full version
        assembled = onto if onto is not None and onto.holds(chain[0]) else Assembled(chain[0])
        for manifest in chain:
            self._apply(assembled, manifest)
        return assembled

    def _apply(self, assembled: Assembled, manifest: WeightManifest) -> None:
        try:
            assembled.apply(manifest, self.read_pieces(manifest))
        except PieceMismatchError as exc:
            raise WeightIntegrityError(f"weight version {manifest.version}: {exc}") from exc

    def load(self, version: int | None = None) -> tuple[dict[str, torch.Tensor], WeightManifest]:
        """All tensors of `version` (default: `latest_version()`) on CPU, built and verified."""
        if version is None and (version := self.latest_version()) is None:
            raise WeightVersionNotFoundError(f"no weights published under {self.root.uri}")
        assembled = self.build(version)
        return assembled.tensors(), self.read_manifest(version)

    def _vanished_error(self, version: int, exc: FileNotFoundError) -> StorageError:
        return WeightVersionNotFoundError(
            f"a file of weight version {version} vanished while reading ({exc}), probably "
            f"deleted by retain(); available versions: {self.versions() or 'none'}"
        )

    def _exists_error(self, version: int) -> StorageError:
        return WeightVersionExistsError(
            f"weight version {version} is already committed under {self.root.uri}; versions "
            f"are immutable: publish a version > {max(self.versions(), default=version)}"
        )

    # -- retention -----------------------------------------------------------------------

    def retain(self, keep: int) -> list[int]:
        """Delete all but the newest `keep` committed versions and what they need, and what no
        kept manifest names; returns the deleted versions, ascending.

        Never deletes the version LATEST names, nor a version on the chain of a kept one (the
        full version and deltas a kept delta is built from). Also deletes manifest-less
        folders older than the newest committed version (dead publishes; newer ones may be in
        progress and stay) and, in kept versions, the objects their manifest does not name.
        Versions go newest first, each one's manifest before its files, so a reader still
        reading one gets `WeightVersionNotFoundError` (vanished), never `WeightIntegrityError`
        (see the module docstring): keep >= 2 leaves generators one publication of slack.
        The fence is checked before each version is deleted and before the leftovers are.
        """
        _check_int(keep, 1, "keep")
        folders = self._scan()
        committed = sorted(v for v, names in folders.items() if MANIFEST_NAME in names)
        protected = {*committed[-keep:], self._read_latest()}
        manifests: dict[int, WeightManifest] = {}
        for version in sorted(v for v in protected if v in committed):
            base = version
            while base is not None:
                protected.add(base)
                try:
                    manifests[base] = manifests.get(base) or self.read_manifest(base)
                except (WeightVersionNotFoundError, WeightIntegrityError):
                    break  # a broken chain: readers detect it; keep what is left of it
                base = manifests[base].base
        newest = max(committed, default=0)
        doomed = sorted(
            (v for v in folders if v not in protected and (v in committed or v < newest)),
            reverse=True,  # a chain's link never goes before the versions built on it
        )
        for version in doomed:
            self._check_fence()
            if version in committed:  # manifest first: the version is gone for new readers
                self.fs.rm_file(self._path(version, MANIFEST_NAME))
            self.fs.rm(self._path(version), recursive=True)
        leftovers = [
            self._path(version, name)
            for version, manifest in sorted(manifests.items())  # every one of them is kept
            for name in sorted(folders.get(version, set()) - _named(manifest))
        ]
        if leftovers:
            self._check_fence()
            self.fs.rm(leftovers)
        return sorted(doomed)


def _publish_of(file: str) -> str | None:
    """The publish id a data file was written by (None: not a data file's name)."""
    match = _DATA_FILE.fullmatch(file)
    return None if match is None else match["publish"]


def _named(manifest: WeightManifest) -> set[str]:
    """The objects of a committed version's folder that its readers need."""
    return {MANIFEST_NAME, *(entry.file for entry in manifest.files)}


def _piece_of_key(key: str) -> str:
    """The piece key (`<name>@<start>`) a safetensors entry belongs to: a full piece's own key
    ends in its start's digits, a delta's two entries add `.index` / `.values` to it."""
    return key.removesuffix(".index").removesuffix(".values")


def _first_key(name: str, piece: PieceEntry) -> str:
    """The safetensors key that locates `piece` in the files written."""
    key = piece_key(name, piece.start)
    return key if piece.encoding == "full" else f"{key}.index"


def _json_object(config: dict[str, Any] | None) -> dict[str, Any]:
    """A JSON-normalised copy of the caller's model config (tuples become lists)."""
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise TypeError(f"model_config must be a dict, got {type(config).__name__}")
    try:
        return json.loads(json.dumps(config))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"model_config must be JSON-serialisable: {exc}") from exc
