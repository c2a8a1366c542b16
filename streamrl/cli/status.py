"""`streamrl status`: where a run stands, read from its storage (`streamrl.runs.status`) and shown
as a table or a JSON line (`streamrl.runs.status_format`); `streamrl scale`: how many generators a
run placed on work pools has (`flows.pools`).

`add_commands(commands)` registers them on the subparsers of `streamrl.cli.main.build_parser`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

EXAMPLES_STATUS = """\
examples:
  streamrl status ./runs/demo
  streamrl status ./runs/demo --watch 10          redraw every 10 s until the run finishes
  streamrl status ./runs/demo --plot curves.png   also draw the curves into an image
  streamrl status ./runs/demo --json | jq .lag_groups
  streamrl status s3://bucket/runs/x --watch 30 --json   one JSON object per line
  AWS_ENDPOINT_URL=http://127.0.0.1:8333 streamrl status s3://bucket/runs/x
Reads only the run's storage (run.json, stream commit log, checkpoints, weights, metrics, stop
marker), so it works from any machine that can read the run, live or finished. State: not
started, running (started, no stop marker), stopping (stop marker before total_steps) or
finished (stop marker and the learner at total_steps). Stream lag = groups written − groups the
learner consumed, leaving out quarantined segments (corrupt ones readers skip; counted apart).
Failed reward calls (errors, timeouts) and the groups dropped for them come from the generators'
commit records, per generator and in all. Below the status, the learning curves: one text chart
per metric over the logged steps (first → last value, [min .. max]), held-out evaluations and
the steps where health conditions fired; --plot draws them into a PNG (the Prefect UI's
"curves" artifact). Exit status 2 when there is no run at RUN_URI.
"""

_CLEAR_SCREEN = "\033[H\033[2J"


def _positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"--watch takes seconds > 0, got {text!r}")
    return seconds


def _open_run(run_uri: str) -> Any:
    """The run at `run_uri`, with its configuration's S3 endpoint and options; never creates
    anything (a mistyped local URI must not leave a folder behind)."""
    from storage.control.manifest import open_run
    from storage.fs import open_location

    run = open_location(run_uri, check=False)
    if run.is_local:
        return run
    storage = open_run(run).config.get("storage", {})  # StorageError naming the URI
    return open_location(
        run_uri,
        endpoint_url=storage.get("endpoint_url"),
        storage_options=storage.get("storage_options"),
        check=False,
    )


def _cmd_status(args: argparse.Namespace) -> int:
    from streamrl.runs.curves import RunCurves
    from streamrl.runs.status import FINISHED, read_status
    from streamrl.runs.status_format import format_status, to_json

    run = _open_run(args.run)
    redraw = args.watch is not None and not args.json and sys.stdout.isatty()
    status, history = read_status(run), RunCurves(run)
    try:
        while True:
            history.read()
            curves = history.curves()
            text = to_json(status) if args.json else _with_curves(format_status(status), curves)
            print((_CLEAR_SCREEN if redraw else "") + text, flush=True)
            if args.plot:
                _plot(curves, status, args.plot)
            if args.watch is None or status.state == FINISHED:
                return 0
            time.sleep(args.watch)
            status = read_status(run, previous=status)
            if not args.json and not redraw:
                print()
    except KeyboardInterrupt:  # the way to leave --watch
        return 0


def _with_curves(text: str, curves: Any) -> str:
    """The status, then its text charts as wide as the terminal allows."""
    from streamrl.runs.curves import text_charts

    if not curves:
        return text
    width = max(12, min(48, shutil.get_terminal_size().columns - 70))
    title = f"curves     steps {curves.first_step}..{curves.last_step}"
    return "\n".join([text, title, *(f"  {line}" for line in text_charts(curves, width=width))])


def _plot(curves: Any, status: Any, path: Path) -> None:
    """The curves as a PNG at `path` (replaced whole, so a viewer never sees half a file)."""
    from streamrl.runs.curves import render_png

    title = f"{status.uri} — step {status.step} / {status.total_steps}"
    partial = path.with_name(f".{path.name}.partial")
    partial.write_bytes(render_png(curves, title))
    partial.replace(path)
    print(f"curves drawn into {path}", file=sys.stderr)


EXAMPLES_SCALE = """\
examples:
  streamrl scale s3://bucket/runs/qwen-7b --generators 16
  streamrl scale ./runs/dapo-pools --generators 0       pause generation (the learner waits)
For a run placed on work pools (placement.mode=pools): its `streamrl` flow run starts more
generator flow runs, or asks the newest to flush their open segment and stop, within seconds.
The same as a flow: prefect deployment run scale/default -p run_uri=... -p generators=16
"""


def _cmd_scale(args: argparse.Namespace) -> int:
    from streamrl.runs.scale import scale_generators

    previous = scale_generators(args.run, args.generators)
    was = "not set before" if previous is None else f"was {previous}"
    print(f"{args.run}: {args.generators} generator(s) asked for ({was}); the run's streamrl "
          "flow run starts or stops generator flow runs to match")  # fmt: skip
    return 0


def _count(text: str) -> int:
    count = int(text)
    if count < 0:
        raise argparse.ArgumentTypeError(f"{text} generators: give 0 or more")
    return count


def add_commands(commands: Any) -> None:
    """Register `status` and `scale` on the `streamrl` command's subparsers."""
    scale = commands.add_parser(
        "scale",
        help="set how many generators a run placed on work pools has",
        description="Start or stop generator flow runs of a run placed on work pools.",
        epilog=EXAMPLES_SCALE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    scale.add_argument("run", metavar="RUN_URI", help="the run's root URI")
    scale.add_argument("--generators", type=_count, required=True, metavar="N", help="how many")
    scale.set_defaults(func=_cmd_scale)

    status = commands.add_parser(
        "status",
        help="steps, versions, stream lag and last metrics of a run, read from storage",
        description="Where a run stands, read straight from its storage (live or finished).",
        epilog=EXAMPLES_STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    status.add_argument("run", metavar="RUN_URI", help="the run's root URI")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.add_argument(
        "--watch",
        type=_positive_seconds,
        metavar="SECONDS",
        help="re-read every SECONDS until the run finishes (Ctrl-C to leave)",
    )
    status.add_argument(
        "--plot",
        type=Path,
        metavar="PNG",
        help="also draw the curves into this image (redrawn with --watch)",
    )
    status.set_defaults(func=_cmd_status)
