"""Publishing weight versions: the learner's ranks write a policy version and rank 0 commits it.

Layout under `<run>/weights/`:

    v<version:08d>/<publish>-r<rank>-<i>.safetensors    pieces written by learner rank <rank>
    v<version:08d>/<publish>-part-<rank>-of-<world>.json    `SharePart`: what that rank wrote,
                                    written after its files (or the error that stopped it)
    v<version:08d>/manifest.json    `WeightManifest` (storage.weights.manifest): every tensor, its
                                    pieces and their files, checksums; written LAST by rank 0,
                                    create-if-absent, once every rank's part is there
    LATEST                          {"version": N}; written after the manifest, the only object
                                    ever overwritten (atomic rename locally, one PUT on S3)

`<publish>` is one id per publishing learner life, so a dead life's leftovers in a folder are
never mistaken for this one's. No host holds the whole model: each rank writes its own pieces
(`write_share`; packing them into files: `storage.weights.files`); rank 0 then `commit`s. A
version exists exactly when its manifest does: a publish killed before `commit` leaves a folder
no reader lists or opens, deleted by retention once a newer version is committed. Versions are
immutable; publishing one that has a manifest fails; NaN or inf is refused before anything is
written.

A version is *full* or a *delta* against the previous version (`manifest.base`). Readers
(`storage.weights.versions`) build a version from the nearest full version and the deltas after it;
retention (`storage.weights.retention`) deletes whatever no committed manifest names, never a
version a kept delta needs.

Fencing: with a `fence` (the learner's lease, `storage.control.fencing.Fence`), `fence.check()` runs
right before every write another learner could clobber — the manifest, LATEST, each deletion
of retention — and what it raises (the lease was lost) stops the write; the manifest records
the epoch it returned.
"""

from __future__ import annotations

import json
import posixpath
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import torch

from storage.fs import Location, StorageError, put_if_absent, replace_object
from storage.weights.files import upload_share
from storage.weights.manifest import SharePart, TensorEntry, WeightManifest, publish_of
from storage.weights.pieces import TensorShare, encode_share
from storage.weights.retention import retain_versions
from storage.weights.shares import check_finite, new_publish_id, whole_shares
from storage.weights.versions import (
    LATEST_NAME,
    MANIFEST_NAME,
    WeightIntegrityError,
    WeightStore,
    WeightVersionNotFoundError,
    check_int,
)

if TYPE_CHECKING:
    from storage.control.fencing import Fence

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "PublishAbandonedError",
    "WeightVersionExistsError",
    "WeightWriter",
]

DEFAULT_SHARD_BYTES = 512 * 1024**2


class WeightVersionExistsError(StorageError):
    """The version was already committed; versions are immutable."""


class PublishAbandonedError(StorageError):
    """A rank could not write its share of a version (its part names the error), or not in
    time: the version was not committed and LATEST did not move."""


class WeightWriter:
    """Writes versions of one run's policy weights under `<run>/weights/` (see the module
    docstring); `reader` reads the same folder.

    `fence`: checked right before the manifest is written, LATEST moves or `retain` deletes
    anything (None: the writer holds no lease, as single-process tools)."""

    def __init__(self, location: Location, fence: Fence | None = None) -> None:
        self.reader = WeightStore(location)
        self.root, self.fs, self.fence = self.reader.root, self.reader.fs, fence

    def _check_fence(self) -> int | None:
        """The epoch the fence holds (None without a fence); what it raises propagates."""
        return None if self.fence is None else self.fence.check()

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
        check_int(version, 1, "weight version")
        check_int(shard_bytes, 1, "shard_bytes")
        if not shares:
            raise ValueError("no tensors to publish")
        check_finite(version, {name: share.data for name, share in shares.items()})
        if self.fs.exists(self.reader.path(version, MANIFEST_NAME)):
            raise self._exists_error(version)
        if base is not None and not 0 < base[0] < version:
            raise ValueError(f"base version {base[0]} must be in [1, {version})")
        encoded = encode_share(
            shares, None if base is None else base[1], max_delta_ratio=max_delta_ratio
        )
        if self.root.is_local:
            self.fs.makedirs(self.reader.path(version), exist_ok=True)
        files, tensors = upload_share(
            self.reader.version_folder(version), publish_id, rank, encoded, shard_bytes
        )
        delta_base = base[0] if base is not None and encoded.has_delta else None
        part = SharePart(rank, world, files, tensors, base=delta_base)
        self._write_part(version, publish_id, part)
        return part

    def abandon_share(
        self, version: int, *, publish_id: str, rank: int, world: int, error: str
    ) -> None:
        """Record that rank `rank` could not write its share: `commit` stops waiting as soon as
        it reads this, whatever the other ranks do."""
        self._write_part(version, publish_id, SharePart(rank, world, error=error))

    def _write_part(self, version: int, publish_id: str, part: SharePart) -> None:
        path = self.reader.path(version, _part_name(publish_id, part.rank, part.world))
        replace_object(self.root, path, part.to_json().encode())

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

    def retain(self, keep: int) -> list[int]:
        """Delete all but the newest `keep` committed versions and what they need, and what no
        kept manifest names, the fence checked before each deletion; returns the deleted
        versions, ascending (`storage.weights.retention.retain_versions`)."""
        return retain_versions(self.reader, keep, fence=self.fence)

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
        manifest_path = self.reader.path(version, MANIFEST_NAME)
        if put_if_absent(self.fs, manifest_path, manifest.to_json().encode()):
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
            manifest = self.reader.read_manifest(version)
        except WeightVersionNotFoundError:
            return None
        if manifest.files and all(publish_of(f.file) == publish_id for f in manifest.files):
            return manifest
        raise self._exists_error(version)

    def _listing(self, version: int) -> dict[str, int]:
        """Object name → size in the folder of `version` (one listing)."""
        try:
            entries = self.fs.ls(self.reader.path(version), detail=True)
        except FileNotFoundError:
            return {}
        return {posixpath.basename(e["name"]): e["size"] for e in entries}

    def _wait_for_parts(
        self, version: int, publish_id: str, world: int, timeout_s: float
    ) -> list[SharePart]:
        """Every rank's part, read as each appears; the first one recording an error, or the
        deadline, ends the wait with `PublishAbandonedError`."""
        paths = [self.reader.path(version, _part_name(publish_id, r, world)) for r in range(world)]
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

    def _exists_error(self, version: int) -> StorageError:
        return WeightVersionExistsError(
            f"weight version {version} is already committed under {self.root.uri}; versions "
            f"are immutable: publish a version > {max(self.reader.versions(), default=version)}"
        )


def _part_name(publish_id: str, rank: int, world: int) -> str:
    return f"{publish_id}-part-{rank:05d}-of-{world:05d}.json"


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
