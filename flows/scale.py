"""The `scale` flow: set how many generators a run placed on work pools has.

    prefect deployment run scale/default -p run_uri=s3://bucket/runs/x -p generators=16

The same as `streamrl scale RUN_URI --generators N`: the run's `streamrl` flow run starts more
generator flow runs, or asks the newest to flush their open segment and stop (`flows.pools`).
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from streamrl.runs.scale import scale_generators

__all__ = ["scale_run"]


@flow(name="scale", log_prints=True)
def scale_run(run_uri: str, generators: int) -> int:
    """Ask the run at `run_uri` for `generators` generators; returns the count asked for."""
    if generators < 0:
        raise ValueError(f"generators={generators}: give 0 or more")
    previous = scale_generators(run_uri, generators)
    was = "not set before" if previous is None else f"was {previous}"
    get_run_logger().info("%s: %d generator(s) asked for (%s)", run_uri, generators, was)
    return generators
