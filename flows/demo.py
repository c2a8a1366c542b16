"""`make demo`: a DAPO run of SmolLM2-135M-Instruct on the bundled arithmetic problems, on this
machine, through the `streamrl` flow with Prefect's temporary local server (no separate server
to start). The run lives under ./runs/; the end prints reward and accuracy before and after.

    python -m flows.demo [--steps N] [--run-uri DIR] [--generators N] [KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import sys
import time

from flows.run import streamrl_run
from storage.fs import open_location
from streamrl.launch import format_summary, run_summary

DEFAULT_STEPS = 16


def main(argv: list[str] | None = None) -> int:
    raw = argparse.RawTextHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="learner steps")
    parser.add_argument("--run-uri", default=None, help="default: ./runs/demo-<time>")
    parser.add_argument("--generators", type=int, default=1)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    run_uri = args.run_uri or time.strftime("./runs/demo-%Y%m%d-%H%M%S")
    state = streamrl_run(
        preset="dapo",
        size="smollm2-cpu",
        overrides=[f"learner.total_steps={args.steps}", *args.overrides],
        run_uri=run_uri,
        generators=args.generators,
        return_state=True,
    )
    print()
    print(format_summary(run_summary(open_location(run_uri))))
    if not state.is_completed():
        print(f"demo failed: {state.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
