"""Opening a run: what every process of a run starts with, below the supervisor.

- `prepare_run`: create `run.json`, or check it on resume (incompatible fields listed) and
  record the resumed configuration as the run's current one.
- `open_run_location`: a configuration's run root, with its storage endpoint and options.
- `open_existing_run` / `load_run_config`: an existing run's current configuration (and root),
  as the learner, generators, evaluator, status and export read it.
- `stop_on_sigterm`: the stop event a run process watches.
- `scale_generators`: ask a run placed on work pools for N generators (`streamrl scale`).

Components (learner, generator, evaluator, export, cli) import this module, never the
supervisor (`streamrl.launch`) that starts them.
"""

from __future__ import annotations

import json
import signal
import threading
from typing import Any

from storage.control import clear_stop, requested_generators, set_requested_generators
from storage.fs import Location, StorageError, open_location
from storage.manifest import create_run, open_run
from streamrl.config import RunConfig, validate_config

__all__ = [
    "CURRENT_CONFIG",
    "load_run_config",
    "open_existing_run",
    "open_run_location",
    "prepare_run",
    "scale_generators",
    "stop_on_sigterm",
]

CURRENT_CONFIG = ("control", "config.json")


def open_run_location(config: RunConfig) -> Location:
    """The run's root, with the storage endpoint and options of its configuration."""
    storage = config.storage
    return open_location(
        storage.run_uri,
        endpoint_url=storage.endpoint_url,
        storage_options=storage.storage_options,
    )


def prepare_run(config: RunConfig, *, resume: bool = False) -> tuple[RunConfig, Location]:
    """Create the run at `config.storage.run_uri`, or (with `resume`) reopen it.

    Resuming checks `config` against the stored one (only resume-safe fields may differ, such
    as `learner.total_steps` to extend a run; see `storage.manifest.open_run`), records it as
    the run's current configuration (`<run>/control/config.json`: run.json is written once)
    and clears the stop marker a finished or stopped life left behind. Without `resume`, an
    existing run is refused: pass `resume=True` or choose another `storage.run_uri`."""
    run = open_run_location(config)
    wanted = config.model_dump(mode="json")
    if resume:
        open_run(run, wanted)
        run.fs.makedirs(run.join("control"), exist_ok=True)
        run.fs.pipe_file(run.join(*CURRENT_CONFIG), json.dumps(wanted, indent=2).encode())
        clear_stop(run)
    elif run.fs.exists(run.join("run.json")):
        raise StorageError(
            f"a run already exists at {run.uri}; resume it (--resume, or the flow's resume "
            "parameter) or choose another storage.run_uri"
        )
    else:
        create_run(run, wanted)
    return config, run


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
    (`prepare_run`), else run.json's."""
    current = run.join(*CURRENT_CONFIG)
    if run.fs.exists(current):
        return validate_config(json.loads(run.fs.cat_file(current)), source=current)
    return validate_config(open_run(run).config, source=f"{run.uri}/run.json")


def stop_on_sigterm(stop: threading.Event | None = None) -> threading.Event:
    """`stop`, or a new event, set by SIGTERM when called from the main thread: a process
    that watches it finishes its work in hand and exits 0."""
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    return stop


def scale_generators(run_uri: str, count: int) -> int | None:
    """Ask the run at `run_uri`, placed on work pools, for `count` generators (the `streamrl`
    flow supervising it starts or stops generator flow runs to match within seconds); the
    count asked for before, None when never asked. Raises `StorageError` for a run whose
    processes run on one machine (`placement.mode=local`)."""
    config, run = open_existing_run(run_uri)
    if not config.placement.pools:
        raise StorageError(
            f"the run at {run.uri} runs its processes on one machine (placement.mode=local): "
            "only a run placed on work pools (placement.mode=pools) is scaled this way; add a "
            f"generator to it with: prefect deployment run generator/default -p run_uri={run_uri}"
        )
    previous = requested_generators(run)
    set_requested_generators(run, count)
    return previous
