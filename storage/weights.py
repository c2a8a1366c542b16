"""The weight store: the learner publishes policy versions, generators load them.

Layout under `<run>/weights/`:

    v<version:08d>/model-00001-of-0000N.safetensors ...   shards (safetensors)
    v<version:08d>/manifest.json    `WeightManifest`: every tensor, its shard, sha256 + size per
                                    shard, the model config; written LAST, create-if-absent
    LATEST                          {"version": N}; written after the manifest, the only object
                                    ever overwritten (atomic rename locally, one PUT on S3)

Publishing is two steps: `write_shards` uploads the shards (concurrently on S3), `commit`
writes the manifest and then LATEST. A version exists exactly when its manifest does: a
publisher killed before `commit` leaves a folder that no reader lists or opens, and that
`retain` deletes once a newer version is committed. Versions are immutable; publishing one
that has a manifest fails; a state dict holding NaN or inf is refused before anything is
written. Readers verify the size and sha256 of every shard before
deserialising it. One publisher per run (the learner's rank 0) is assumed: two publishers of
the same version could overwrite each other's shards, which loading would then detect.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from collections.abc import Collection, Iterator, Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any, NamedTuple

import safetensors.torch
import torch

from storage.fs import Location, StorageError, put_if_absent, replace_object

__all__ = [
    "IntactVersion",
    "NonFiniteWeightsError",
    "ShardInfo",
    "TensorSpec",
    "WeightIntegrityError",
    "WeightManifest",
    "WeightStore",
    "WeightVersionExistsError",
    "WeightVersionNotFoundError",
]

MANIFEST_FORMAT = "streamrl.weights.v1"
MANIFEST_NAME = "manifest.json"
LATEST_NAME = "LATEST"
DEFAULT_SHARD_BYTES = 2 * 1024**3
_UPLOAD_BATCH_BYTES = 4 * 1024**3  # serialised shards held in memory per concurrent upload
_VERSION_DIR = re.compile(r"v(\d{8,})")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class WeightIntegrityError(StorageError):
    """A stored object does not match what its manifest (or format) promises."""


class WeightVersionExistsError(StorageError):
    """The version was already committed; versions are immutable."""


class WeightVersionNotFoundError(StorageError):
    """The version has no manifest (never committed, dead publish, or removed by `retain`)."""


class NonFiniteWeightsError(ValueError):
    """A state dict to publish holds NaN or ±inf; nothing of that version was written."""


def _shard_file(index: int, count: int) -> str:
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def _check_finite(version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Refuse NaN/inf weights before anything is uploaded: generators would sample garbage."""
    bad = [
        name
        for name, value in state_dict.items()
        if value.is_floating_point() and not bool(torch.isfinite(value).all())
    ]
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise NonFiniteWeightsError(
            f"refusing to publish weights v{version}: {len(bad)} tensor(s) hold NaN or inf "
            f"({shown}). Nothing was written and LATEST is unchanged; the training that "
            "produced them diverged (lower learner.lr, keep learner.grad_clip on) — resume "
            "from the last committed checkpoint"
        )


def _check_int(value: object, minimum: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value!r}")


class TensorSpec(NamedTuple):
    """dtype (torch name without `torch.`, e.g. "bfloat16") and shape (`()` for a 0-d tensor)."""

    dtype: str
    shape: tuple[int, ...]


def _spec(tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))


@dataclass(frozen=True)
class ShardInfo:
    """One uploaded shard: file name, byte size, sha256 (hex) and its tensors in write order."""

    file: str
    size: int
    sha256: str
    tensors: dict[str, TensorSpec]

    def __post_init__(self) -> None:
        _check_int(self.size, 1, f"size of shard {self.file}")
        if not isinstance(self.sha256, str) or not _SHA256.fullmatch(self.sha256):
            raise ValueError(f"shard {self.file}: sha256 {self.sha256!r} is not 64 hex digits")
        if not self.tensors:
            raise ValueError(f"shard {self.file} holds no tensors")
        specs = {
            name: TensorSpec(dtype, tuple(shape)) for name, (dtype, shape) in self.tensors.items()
        }
        object.__setattr__(self, "tensors", specs)  # JSON gives lists: normalise to TensorSpec
        for name, (dtype, shape) in specs.items():
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
            for dim in shape:
                _check_int(dim, 0, f"each dimension of tensor {name!r}")


@dataclass(frozen=True)
class WeightManifest:
    """What one committed version holds; the only thing readers trust.

    Invariants (checked on construction, so on every read):
    - `version` is an int > 0 and equals the folder it is stored in (checked by the reader);
    - `shards` is non-empty and named `model-{i:05d}-of-{n:05d}.safetensors`, i = 1..n in order;
    - every tensor name appears in exactly one shard (tied weights are stored under each name);
    - each shard's `size` and `sha256` are those of its stored bytes (checked on every load);
    - `model_config` is the publisher's JSON object; `created_at` is ISO 8601 UTC.
    """

    version: int
    shards: tuple[ShardInfo, ...]
    model_config: dict[str, Any]
    created_at: str

    def __post_init__(self) -> None:
        _check_int(self.version, 1, "weight version")
        if not self.shards:
            raise ValueError("a weight manifest needs at least one shard")
        expected = [_shard_file(i, len(self.shards)) for i in range(1, len(self.shards) + 1)]
        if [shard.file for shard in self.shards] != expected:
            raise ValueError(f"shards must be named {expected} in order")
        if len(self.tensors) != sum(len(shard.tensors) for shard in self.shards):
            raise ValueError("a tensor name appears in more than one shard")
        if not isinstance(self.model_config, dict):
            raise ValueError("model_config must be a JSON object")
        datetime.fromisoformat(self.created_at)

    @property
    def tensors(self) -> dict[str, TensorSpec]:
        """Every tensor name → its dtype and shape, in write order."""
        return {name: spec for shard in self.shards for name, spec in shard.tensors.items()}

    @property
    def weight_map(self) -> dict[str, str]:
        """Every tensor name → the shard file holding it (as in HF `*.index.json`)."""
        return {name: shard.file for shard in self.shards for name in shard.tensors}

    def to_json(self) -> str:
        return json.dumps({"format": MANIFEST_FORMAT, **asdict(self)})

    @classmethod
    def from_json(cls, text: str | bytes) -> WeightManifest:
        """Parse and validate; any malformation raises `ValueError`."""
        raw = json.loads(text)
        try:
            if raw.pop("format") != MANIFEST_FORMAT:
                raise ValueError(f"format is not {MANIFEST_FORMAT!r}")
            shards = tuple(ShardInfo(**shard) for shard in raw.pop("shards"))
            return cls(shards=shards, **raw)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"malformed weight manifest: {exc!r}") from exc


def _plan_shards(state_dict: Mapping[str, torch.Tensor], shard_bytes: int) -> list[list[str]]:
    """Greedy packing in state-dict order; a tensor over `shard_bytes` ends up alone."""
    groups: list[list[str]] = []
    filled = 0
    for name, tensor in state_dict.items():
        size = tensor.numel() * tensor.element_size()
        if groups and filled + size <= shard_bytes:
            groups[-1].append(name)
            filled += size
        else:
            groups.append([name])
            filled = size
    return groups


def _cpu_contiguous(names: list[str], state_dict: Mapping[str, torch.Tensor]) -> dict:
    """The shard's tensors on CPU, contiguous, no two sharing storage (safetensors refuses)."""
    out: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name in names:
        tensor = state_dict[name].detach().to("cpu").contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in storages:  # tied weights (e.g. lm_head = embed_tokens): own copy
            tensor = tensor.clone()
            pointer = tensor.untyped_storage().data_ptr()
        storages.add(pointer)
        out[name] = tensor
    return out


@dataclass(frozen=True)
class IntactVersion:
    """What `WeightStore.load_newest_intact` found: the version loaded (None: none intact) and
    its tensors, the versions that failed verification (→ why) and those that vanished."""

    version: int | None
    tensors: dict[str, torch.Tensor]
    corrupt: dict[int, str]
    vanished: list[int]


class WeightStore:
    """Versions of one run's policy weights under `<run>/weights/` (see module docstring)."""

    def __init__(self, location: Location) -> None:
        self.root = location.child("weights")
        self.fs = location.fs

    def _path(self, version: int, *name: str) -> str:
        """The folder of `version`, or the object `name` in it."""
        return self.root.join(f"v{version:08d}", *name)

    def publish(
        self,
        version: int,
        state_dict: Mapping[str, torch.Tensor],
        *,
        model_config: dict[str, Any] | None = None,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
    ) -> WeightManifest:
        """Store `state_dict` as `version`: `write_shards`, then `commit`."""
        config = _json_object(model_config)  # a bad config fails before any upload
        shards = self.write_shards(version, state_dict, shard_bytes=shard_bytes)
        return self.commit(version, shards, model_config=config)

    def write_shards(
        self,
        version: int,
        state_dict: Mapping[str, torch.Tensor],
        *,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
    ) -> list[ShardInfo]:
        """Serialise and upload the shards of `version`; invisible to readers until `commit`.

        Tensors may live on any device, be non-contiguous or tied; every name is stored with its
        own data (what vLLM and transformers loaders expect). Shards hold tensors in state-dict
        order up to `shard_bytes`; a larger tensor gets a shard of its own.
        Raises `WeightVersionExistsError` if `version` is committed.
        """
        _check_int(version, 1, "weight version")
        _check_int(shard_bytes, 1, "shard_bytes")
        if not state_dict:
            raise ValueError("state_dict is empty: nothing to publish")
        for name, value in state_dict.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"state_dict keys must be non-empty strings, got {name!r}")
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"state_dict[{name!r}] is a {type(value).__name__}, not a Tensor")
        _check_finite(version, state_dict)
        if self.fs.exists(self._path(version, MANIFEST_NAME)):
            raise self._exists_error(version)
        groups = _plan_shards(state_dict, shard_bytes)
        if self.root.is_local:
            self.fs.makedirs(self._path(version), exist_ok=True)
        shards: list[ShardInfo] = []
        pending: dict[str, bytes] = {}
        for index, names in enumerate(groups, start=1):
            tensors = _cpu_contiguous(names, state_dict)
            data = safetensors.torch.save(tensors)
            specs = {name: _spec(tensor) for name, tensor in tensors.items()}
            file = _shard_file(index, len(groups))
            shards.append(ShardInfo(file, len(data), hashlib.sha256(data).hexdigest(), specs))
            pending[self._path(version, file)] = data
            if sum(map(len, pending.values())) >= _UPLOAD_BATCH_BYTES or index == len(groups):
                self.fs.pipe(pending)  # concurrent PUTs on S3
                pending = {}
        return shards

    def commit(
        self, version: int, shards: list[ShardInfo], *, model_config: dict[str, Any] | None = None
    ) -> WeightManifest:
        """Check the uploaded `shards` are all there, write the manifest (create-if-absent),
        then point LATEST at `version`. LATEST always moves to the version just committed."""
        manifest = WeightManifest(
            version, tuple(shards), _json_object(model_config), datetime.now(UTC).isoformat()
        )
        try:  # one listing: every shard there, with the size write_shards recorded
            listing = self.fs.ls(self._path(version), detail=True)
        except FileNotFoundError:
            listing = []
        sizes = {posixpath.basename(entry["name"]): entry["size"] for entry in listing}
        for shard in shards:
            if sizes.get(shard.file) != shard.size:
                raise WeightIntegrityError(
                    f"cannot commit version {version}: shard {shard.file} is missing or not "
                    f"{shard.size} bytes; run write_shards again"
                )
        encoded = manifest.to_json().encode()
        path = self._path(version, MANIFEST_NAME)
        # The name taken: ours if a retried PUT had landed, else an earlier publish's.
        if not put_if_absent(self.fs, path, encoded) and self.fs.cat_file(path) != encoded:
            raise self._exists_error(version)
        # Readers must never see a half-written LATEST.
        replace_object(
            self.root, self.root.join(LATEST_NAME), json.dumps({"version": version}).encode()
        )
        return manifest

    def _scan(self) -> dict[int, bool]:
        """Every version folder → whether it has a manifest (one listing)."""
        folders: dict[int, bool] = {}
        prefix = self.root.path.rstrip("/") + "/"
        for path in self.fs.find(self.root.path, withdirs=True):
            parts = path.removeprefix(prefix).strip("/").split("/")
            if match := _VERSION_DIR.fullmatch(parts[0]):
                has_manifest = parts[1:] == [MANIFEST_NAME]
                folders[int(match[1])] = folders.get(int(match[1]), False) or has_manifest
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
        return sorted(v for v, has_manifest in self._scan().items() if has_manifest)

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

    def load_newest_intact(self, newer_than: int = 0, skip: Collection[int] = ()) -> IntactVersion:
        """The newest committed version above `newer_than` and not in `skip` whose manifest and
        shards all verify, with its tensors (`version` None if there is none). Versions found
        corrupt on the way, or removed by `retain` while being read, are reported, not raised:
        one bad publication must not stop the readers of the ones around it."""
        corrupt: dict[int, str] = {}
        vanished: list[int] = []
        for version in sorted(self.versions(), reverse=True):
            if version <= newer_than:
                break
            if version in skip:
                continue
            try:
                tensors, _ = self.load(version)
            except WeightIntegrityError as exc:
                corrupt[version] = str(exc)
            except WeightVersionNotFoundError:
                vanished.append(version)
            else:
                return IntactVersion(version, tensors, corrupt, vanished)
        return IntactVersion(None, {}, corrupt, vanished)

    def load(self, version: int | None = None) -> tuple[dict[str, torch.Tensor], WeightManifest]:
        """All tensors of `version` (default: `latest_version()`) on CPU, every shard verified."""
        if version is None and (version := self.latest_version()) is None:
            raise WeightVersionNotFoundError(f"no weights published under {self.root.uri}")
        manifest = self.read_manifest(version)
        paths = [self._path(version, shard.file) for shard in manifest.shards]
        try:
            blobs = self.fs.cat(paths)  # concurrent GETs on S3
        except FileNotFoundError as exc:
            raise self._vanished_error(version, exc) from exc
        tensors: dict[str, torch.Tensor] = {}
        for shard, path in zip(manifest.shards, paths, strict=True):
            tensors.update(self._verified(version, shard, blobs.pop(path)))
        return tensors, manifest

    def iter_tensors(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, CPU tensor) of `version`, one shard in memory at a time, each shard verified
        before any of its tensors is yielded. The manifest is read at the call, so a missing
        version fails here rather than at the first `next`."""
        manifest = self.read_manifest(version)

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for shard in manifest.shards:
                try:
                    data = self.fs.cat_file(self._path(version, shard.file))
                except FileNotFoundError as exc:
                    raise self._vanished_error(version, exc) from exc
                yield from self._verified(version, shard, data).items()

        return stream()

    def _verified(self, version: int, shard: ShardInfo, data: bytes) -> dict[str, torch.Tensor]:
        """The shard's tensors in manifest order, after checking sha256, size, names, specs."""
        actual = hashlib.sha256(data).hexdigest()
        if actual != shard.sha256 or len(data) != shard.size:
            raise WeightIntegrityError(
                f"weight version {version} shard {shard.file} is corrupt: expected sha256 "
                f"{shard.sha256} ({shard.size} bytes), got {actual} ({len(data)} bytes)"
            )
        loaded = safetensors.torch.load(data)
        if {name: _spec(tensor) for name, tensor in loaded.items()} != shard.tensors:
            raise WeightIntegrityError(
                f"weight version {version} shard {shard.file}: names, dtypes or shapes differ "
                "from the manifest"
            )
        return {name: loaded[name] for name in shard.tensors}

    def _vanished_error(self, version: int, exc: FileNotFoundError) -> StorageError:
        return WeightVersionNotFoundError(
            f"a shard of weight version {version} vanished while reading ({exc}), probably "
            f"deleted by retain(); available versions: {self.versions() or 'none'}"
        )

    def _exists_error(self, version: int) -> StorageError:
        return WeightVersionExistsError(
            f"weight version {version} is already committed under {self.root.uri}; versions "
            f"are immutable: publish a version > {max(self.versions(), default=version)}"
        )

    def retain(self, keep: int) -> list[int]:
        """Delete all but the newest `keep` committed versions; returns the deleted versions.

        Never deletes the version LATEST names. Also deletes manifest-less folders older than
        the newest committed version (dead publishes); newer ones may be in progress and stay.
        A reader still streaming a deleted version gets `WeightVersionNotFoundError`: keep >= 2
        leaves generators one publication of slack.
        """
        _check_int(keep, 1, "keep")
        folders = self._scan()
        committed = sorted(v for v, has_manifest in folders.items() if has_manifest)
        protected = {*committed[-keep:], self._read_latest()}
        newest = max(committed, default=0)
        doomed = [v for v in sorted(folders) if v not in protected and (folders[v] or v < newest)]
        for version in doomed:
            if folders[version]:  # manifest first: the version is gone for new readers at once
                self.fs.rm_file(self._path(version, MANIFEST_NAME))
            self.fs.rm(self._path(version), recursive=True)
        return doomed


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
