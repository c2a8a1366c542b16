"""Reading a run's weight versions: which are committed, what LATEST names, and building one.

The layout under `<run>/weights/`, what a version is and who writes what in which order are
stated once, in `storage.weights.publish` (the writer); what retention deletes, and in which
order, in `storage.weights.retention`. This side only reads: generators and the evaluator import
it (directly and through `storage.weights.follower`), never the writer.

`WeightStore` lists the committed versions (those with a manifest), reads and validates
manifests, and builds a version from its chain — the nearest full version and the deltas after
it — verifying every file and every rebuilt piece. Two failures are told apart:

- `WeightVersionNotFoundError`: the version is not there — never committed, a dead publish, or
  removed by retention, even while it was being read (retention's deletion order guarantees
  that a link of a chain never goes before the versions built on it);
- `WeightIntegrityError`: the version is there but does not match its manifest (or format); it
  can never be built (versions are immutable), so readers skip it for good.

Also the pieces of the layout the writer and retention share: object names, the version
folder (`WeightStore.version_folder`, `path`), one listing of every folder (`folders`), I/O
batching.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import safetensors.torch
import torch

from storage.fs import Location, StorageError
from storage.weights.manifest import WeightManifest, checksum
from storage.weights.pieces import Assembled, PieceMismatchError

__all__ = [
    "IO_BATCH_BYTES",
    "LATEST_NAME",
    "MANIFEST_NAME",
    "WeightIntegrityError",
    "WeightManifest",
    "WeightStore",
    "WeightVersionNotFoundError",
    "batches",
    "check_int",
]

MANIFEST_NAME = "manifest.json"
LATEST_NAME = "LATEST"
IO_BATCH_BYTES = 512 * 1024**2  # serialised bytes per batch of concurrent PUTs / GETs
_VERSION_DIR = re.compile(r"v(\d{8,})")


class WeightIntegrityError(StorageError):
    """A stored object does not match what its manifest (or format) promises."""


class WeightVersionNotFoundError(StorageError):
    """The version has no manifest (never committed, dead publish, or removed by retention)."""


def check_int(value: object, minimum: int, what: str) -> None:
    """Refuse anything but an int >= `minimum` (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value!r}")


def batches(items: list[tuple[str, int]], limit: int) -> Iterator[list[str]]:
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
    """The committed versions of one run's policy weights under `<run>/weights/`, read-only
    (see the module docstring)."""

    def __init__(self, location: Location) -> None:
        self.root = location.child("weights")
        self.fs = location.fs

    def version_folder(self, version: int) -> Location:
        """The folder of `version` (whether or not it holds anything)."""
        return self.root.child(f"v{version:08d}")

    def path(self, version: int, *name: str) -> str:
        """The folder of `version`, or the object `name` in it."""
        return self.root.join(f"v{version:08d}", *name)

    def folders(self) -> dict[int, set[str]]:
        """Every version folder → the names of the objects in it (one listing), committed or
        not."""
        folders: dict[int, set[str]] = {}
        prefix = self.root.path.rstrip("/") + "/"
        for path in self.fs.find(self.root.path, withdirs=True):
            parts = path.removeprefix(prefix).strip("/").split("/")
            if match := _VERSION_DIR.fullmatch(parts[0]):
                names = folders.setdefault(int(match[1]), set())
                names.update(parts[1:2] if len(parts) == 2 else ())
        return folders

    def read_latest(self) -> int | None:
        """The version LATEST names, whether or not its manifest exists; None if no LATEST."""
        try:
            data = self.fs.cat_file(self.root.join(LATEST_NAME))
        except FileNotFoundError:
            return None
        try:
            version = json.loads(data)["version"]
            check_int(version, 1, "version")
        except (ValueError, KeyError, TypeError):
            raise WeightIntegrityError(
                f"{self.root.uri}/LATEST is malformed: {data[:80]!r}"
            ) from None
        return version

    def versions(self) -> list[int]:
        """Committed versions (those with a manifest), ascending."""
        return sorted(v for v, names in self.folders().items() if MANIFEST_NAME in names)

    def latest_version(self) -> int | None:
        """The version LATEST names if its manifest exists, else the newest committed version
        (the publisher died between manifest and LATEST, or the version was deleted); None if
        nothing is committed."""
        named = self.read_latest()
        if named is not None and self.fs.exists(self.path(named, MANIFEST_NAME)):
            return named
        return max(self.versions(), default=None)

    def read_manifest(self, version: int) -> WeightManifest:
        """The validated manifest of `version`; `WeightVersionNotFoundError` if it has none."""
        check_int(version, 1, "weight version")
        try:
            text = self.fs.cat_file(self.path(version, MANIFEST_NAME))
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
                if not self.fs.exists(self.path(version, MANIFEST_NAME)):
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
        for batch in batches(sizes, IO_BATCH_BYTES):
            paths = {self.path(version, file): file for file in batch}
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
