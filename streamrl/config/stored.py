"""Opening a run: what every process of a run starts with, below the supervisor.

- `prepare_run`: create `run.json`, or check it on resume (incompatible fields listed) and
  record the resumed configuration as the run's current one (`CurrentConfig`).
- `open_run_location`: a configuration's run root, with its storage endpoint and options.
- `open_existing_run` / `load_run_config` / `read_current_config`: an existing run's current
  configuration (and root), checked against run.json, as the learner, generators, evaluator,
  status and export read it.

Whoever can write the run's storage could change `control/config.json`, which every process
reads, so it is checked against run.json on every read. Fields that decide what code runs or
what is trusted (`TRUSTED_FIELDS`) change only through a resume that says so
(`allow_trusted_changes`, `--allow-trusted-changes`), which records the values it allowed.

Components (learner, generator, evaluator, export, cli) import this module, never the
supervisor (`streamrl.supervision.launch`) that starts them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from storage.control.credentials import without_credentials
from storage.control.manifest import create_run, open_run
from storage.control.requests import clear_stop
from storage.fs import Location, StorageError, open_location
from streamrl.algorithms.correction_config import correction_of_importance
from streamrl.config.loading import validate_config
from streamrl.config.run import RunConfig
from streamrl.placement.config import placement_of_older_run

__all__ = [
    "ALLOW_FLAG",
    "CURRENT_CONFIG",
    "TRUSTED_FIELDS",
    "CurrentConfig",
    "TrustedChangeError",
    "load_run_config",
    "open_existing_run",
    "open_run_location",
    "prepare_run",
    "read_current_config",
]

CURRENT_CONFIG = ("control", "config.json")
ALLOW_FLAG = "--allow-trusted-changes"

TRUSTED_FIELDS: tuple[str, ...] = (
    "generator.reward.fn",  # code every generator imports and runs
    "model.path",  # weights, and code when trust_remote_code
    "model.tokenizer",
    "model.critic.init_from",
    "model.trust_remote_code",
    "storage.endpoint_url",  # where every process sends its storage credentials
    "storage.storage_options",  # the same, through s3fs's client_kwargs
    "placement.env",  # the environment of every flow run (PYTHONPATH, LD_PRELOAD, ...)
    "placement.image",  # the container every flow run executes
)
"""Dotted config paths that decide what code runs or what is trusted: changed on resume only with
`allow_trusted_changes` (even those `storage.control.manifest.RESUME_SAFE_FIELDS` lets change)."""

_CONFIG_FORMAT = "streamrl.current-config.v1"
_UNSET = object()


class TrustedChangeError(StorageError):
    """A trusted field would change (or was changed) without `allow_trusted_changes`; the
    message names the fields and the flag."""


@dataclass(frozen=True)
class CurrentConfig:
    """`<run>/control/config.json`: the configuration the run's processes use now, written by
    each resume (run.json keeps the one the run was created with).

    Invariants, checked on every read (`read_current_config`): `config` differs from run.json's
    only in resume-safe fields and in `TRUSTED_FIELDS` whose value is the one recorded in
    `trusted_changes` (path → value a resume allowed with `allow_trusted_changes`). A file
    written before this record held the bare configuration: it reads with no trusted change.
    """

    config: dict[str, Any]
    trusted_changes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.trusted_changes) - set(TRUSTED_FIELDS))
        if unknown:
            raise ValueError(f"trusted_changes names fields that are not trusted: {unknown}")

    def to_json(self) -> bytes:
        body = {
            "format": _CONFIG_FORMAT,
            "config": self.config,
            "trusted_changes": self.trusted_changes,
        }
        return json.dumps(body, indent=2).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> CurrentConfig:
        """Raises `StorageError` naming `where` when the file is no configuration record."""
        try:
            body = json.loads(data)
            if not isinstance(body, dict):
                raise ValueError(f"a JSON object is expected, got {type(body).__name__}")
            if "format" not in body:  # written before this record: the bare configuration
                return cls(body)
            if body["format"] != _CONFIG_FORMAT:
                raise ValueError(f"unknown format {body['format']!r}")
            config, allowed = body["config"], body.get("trusted_changes", {})
            if not isinstance(config, dict) or not isinstance(allowed, dict):
                raise ValueError("config and trusted_changes must be JSON objects")
            return cls(config, allowed)
        except (ValueError, KeyError) as exc:
            raise StorageError(
                f"{where} is not a run configuration record ({exc}); resume the run again, "
                "which rewrites it"
            ) from None


def open_run_location(config: RunConfig) -> Location:
    """The run's root, with the storage endpoint and options of its configuration."""
    storage = config.storage
    return open_location(
        storage.run_uri,
        endpoint_url=storage.endpoint_url,
        storage_options=storage.storage_options,
    )


def prepare_run(
    config: RunConfig, *, resume: bool = False, allow_trusted_changes: bool = False
) -> tuple[RunConfig, Location]:
    """Create the run at `config.storage.run_uri`, or (with `resume`) reopen it.

    Resuming checks `config` against the stored one (only resume-safe fields may differ, such as
    `learner.total_steps` to extend a run; see `storage.control.manifest.open_run`), records it as
    the run's current configuration (`<run>/control/config.json`: run.json is written once) and
    clears the stop marker a finished or stopped life left behind. A field of `TRUSTED_FIELDS` may
    differ from the value the run uses now only with `allow_trusted_changes`
    (`--allow-trusted-changes`); otherwise `TrustedChangeError` names the fields and the flag. A
    setting of a component neither the run nor `config` has stays as the run has it
    (`_unused_as_stored`). Without `resume`, an existing run is refused: pass `resume=True` or
    choose another `storage.run_uri`."""
    run = open_run_location(config)
    wanted = config.model_dump(mode="json")
    if resume:
        stored = _stored_config(run)
        config = _unused_as_stored(config, stored)
        wanted = config.model_dump(mode="json")
        trusted, wanted_trusted = _trusted_values(stored), _trusted_values(wanted)
        # Judged against what the run uses now: checked, so a file changed outside a resume
        # is refused too.
        changed = {} if allow_trusted_changes else _changes(run, wanted_trusted)
        if changed:
            raise TrustedChangeError(
                f"resuming run {run.uri} would change fields that decide what code runs or "
                f"what is trusted:\n{_lines(changed)}\nIf that is meant, resume with "
                f"{ALLOW_FLAG} (`streamrl run --resume {ALLOW_FLAG}`, "
                "prepare_run(..., allow_trusted_changes=True)); otherwise restore them"
            )
        # every other field as a resume may
        open_run(run, _with_trusted_of(wanted, stored), read_as=as_this_version_reads)
        allowed = {path: v for path, v in wanted_trusted.items() if v != trusted[path]}
        record = CurrentConfig(wanted, allowed)
        run.fs.makedirs(run.join("control"), exist_ok=True)
        run.fs.pipe_file(run.join(*CURRENT_CONFIG), record.to_json())
        clear_stop(run)
    elif run.fs.exists(run.join("run.json")):
        raise StorageError(
            f"a run already exists at {run.uri}; resume it (--resume, or the flow's resume "
            "parameter) or choose another storage.run_uri"
        )
    else:
        create_run(run, wanted)
    return config, run


def _unused_as_stored(config: RunConfig, stored: Mapping[str, Any]) -> RunConfig:
    """`config` with the settings of a component neither it nor the stored run has taken from
    `stored`: they change nothing that is learned, so a preset that changed them since (the
    size presets' critic rate) must not block a resume. Today: `learner.critic_lr` without a
    value model (`model.critic`)."""
    if config.model.critic is not None or stored["model"].get("critic") is not None:
        return config
    learner = config.learner.model_copy(update={"critic_lr": stored["learner"]["critic_lr"]})
    return config.model_copy(update={"learner": learner})


def open_existing_run(
    run_uri: str, storage_options: dict[str, Any] | None = None, *, check: bool = True
) -> tuple[RunConfig, Location]:
    """An existing run's configuration and its root, reopened with the storage endpoint and
    options of that configuration (`storage_options` win): what every run process starts
    with."""
    config = load_run_config(open_location(run_uri, storage_options=storage_options, check=check))
    run = open_location(
        run_uri,
        endpoint_url=config.storage.endpoint_url,
        storage_options={**config.storage.storage_options, **(storage_options or {})},
        check=check,
    )
    return config, run


def load_run_config(run: Location) -> RunConfig:
    """The configuration of the run at `run`: its current one when a resume recorded it
    (`prepare_run`), else run.json's; checked against run.json (`read_current_config`)."""
    source = f"{run.uri}/{'/'.join(CURRENT_CONFIG)} (checked against run.json)"
    return validate_config(read_current_config(run), source=source)


def read_current_config(run: Location) -> dict[str, Any]:
    """The run's current configuration as JSON: control/config.json when a resume wrote it, else
    run.json's. Checked on every read: it may differ from run.json only where a resume may change a
    field (`storage.control.manifest.RESUME_SAFE_FIELDS`) and, for `TRUSTED_FIELDS`, only to the
    values a resume allowed with `allow_trusted_changes`. Raises `StorageError` (a
    `TrustedChangeError` for trusted fields) naming every other difference and the fix."""
    stored = _stored_config(run)
    current = _read_current(run)
    if current is None:
        return stored
    where = f"{run.uri}/{'/'.join(CURRENT_CONFIG)}"
    try:
        open_run(run, _with_trusted_of(current.config, stored), read_as=as_this_version_reads)
    except StorageError as exc:
        raise StorageError(
            f"{where} does not match run.json in fields a resume cannot change ({exc}). It "
            "was not written by a resume: restore it, or resume the run again, which rewrites "
            "it"
        ) from None
    trusted, now = _trusted_values(stored), _trusted_values(current.config)
    unallowed = {
        path: (trusted[path], value)
        for path, value in now.items()
        if value != trusted[path] and current.trusted_changes.get(path, _UNSET) != value
    }
    if unallowed:
        raise TrustedChangeError(
            f"{where} changes fields that decide what code runs or what is trusted, and no "
            f"resume allowed these values:\n{_lines(unallowed)}\nRestore run.json's values "
            f"there, or resume with {ALLOW_FLAG} (`streamrl run --resume {ALLOW_FLAG}`, "
            "prepare_run(..., allow_trusted_changes=True)) to make the change on purpose"
        )
    return current.config


def _stored_config(run: Location) -> dict[str, Any]:
    """run.json's configuration, as this version of streamrl reads it."""
    return as_this_version_reads(open_run(run).config)


def as_this_version_reads(stored: Mapping[str, Any]) -> dict[str, Any]:
    """A stored configuration (run.json, control/config.json) in this version's spelling, so
    that a run created by an older version resumes: placement fields of a local run dropped
    (`placement_of_older_run`), and `algorithm.importance` written as the `algorithm.correction`
    block it means; then every field filled in as a current config dumps it (a field added
    since the run was created takes its default), credentials left out as they were."""
    config = placement_of_older_run(stored)
    algorithm = config.get("algorithm")
    if isinstance(algorithm, Mapping) and "importance" in algorithm:
        rest = {k: v for k, v in algorithm.items() if k != "importance"}
        config["algorithm"] = {
            **rest,
            "correction": correction_of_importance(algorithm["importance"]),
        }
    full = validate_config(config, source="the run's stored configuration")
    return without_credentials(full.model_dump(mode="json"))


def _read_current(run: Location) -> CurrentConfig | None:
    path = run.join(*CURRENT_CONFIG)
    try:
        data = run.fs.cat_file(path)
    except FileNotFoundError:
        return None
    current = CurrentConfig.from_json(data, f"{run.uri}/{'/'.join(CURRENT_CONFIG)}")
    return replace(current, config=as_this_version_reads(current.config))


def _trusted_values(config: Mapping[str, Any]) -> dict[str, Any]:
    """{path: value} of every `TRUSTED_FIELDS` entry, defaults filled in (an older run.json
    lacks fields added since), None where a parent is null (no critic)."""
    full = validate_config(config, source="the run's configuration").model_dump(mode="json")
    values = {}
    for path in TRUSTED_FIELDS:
        node: Any = full
        for part in path.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        values[path] = node
    return values


def _with_trusted_of(config: Mapping[str, Any], stored: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of `config` whose `TRUSTED_FIELDS` are as in `stored` (absent where absent),
    so comparing it with `stored` judges the other fields only."""
    copy = json.loads(json.dumps(config))
    for path in TRUSTED_FIELDS:
        *parents, name = path.split(".")
        into, source = copy, stored
        for part in parents:
            into = into.get(part) if isinstance(into, dict) else None
            source = source.get(part) if isinstance(source, Mapping) else None
        if not isinstance(into, dict):
            continue
        if isinstance(source, Mapping) and name in source:
            into[name] = source[name]
        else:
            into.pop(name, None)
    return copy


def _changes(run: Location, wanted: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{path: (value now, value wanted)} of the trusted fields `wanted` changes."""
    now = _trusted_values(read_current_config(run))
    return {path: (now[path], value) for path, value in wanted.items() if value != now[path]}


def _lines(changes: dict[str, tuple[Any, Any]]) -> str:
    return "\n".join(
        f"  - {path}: {json.dumps(old)} → {json.dumps(new)}" for path, (old, new) in changes.items()
    )
