"""`streamrl scale`: how many generators a run placed on work pools should have."""

from __future__ import annotations

from storage.control.requests import requested_generators, set_requested_generators
from storage.fs import StorageError
from streamrl.config.stored import open_existing_run

__all__ = ["scale_generators"]


def scale_generators(run_uri: str, count: int) -> int | None:
    """Ask the run at `run_uri`, placed on work pools, for `count` generators (the `streamrl`
    flow supervising it starts or stops generator flow runs to match within seconds); the
    count asked for before, None when never asked. Raises `PlacementError` for a run whose
    processes run on one machine (`placement.mode=local`), `StorageError` for more than
    `placement.max_generators`."""
    config, run = open_existing_run(run_uri)
    maximum = config.placement.scaling_limit(run.uri)
    if count > maximum:
        raise StorageError(
            f"{count} generators is more than placement.max_generators ({maximum}) of the run "
            f"at {run.uri}; ask for at most {maximum}, or resume the run with a larger "
            "placement.max_generators"
        )
    previous = requested_generators(run, maximum)
    set_requested_generators(run, count)
    return previous
