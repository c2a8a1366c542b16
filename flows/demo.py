"""`make demo`: a DAPO run of SmolLM2-135M-Instruct on the bundled arithmetic problems, on this
machine, through the `streamrl` flow with Prefect's temporary local server (no separate server
to start). The run lives under ./runs/; the end prints reward and accuracy before and after.

    python -m flows.demo [--steps N] [--run-uri DIR] [--resume] [--generators N] [KEY=VALUE ...]

The terminal shows a short header (the run, where its logs are, the placement plan), then one
line per learner step and streamrl's warnings. Everything else — Prefect's server and engine
messages, vLLM's and torch's start-up output — goes to `<run>/logs/demo.log` (each process's
own output to `<run>/logs/<process>.log`). Ctrl-C stops every process of the run; the last
checkpoint stays intact and the terminal says how to resume.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import time
from pathlib import Path
from typing import IO

from flows.run import streamrl_run
from storage.fs import open_location
from streamrl.config_base import ConfigError
from streamrl.config_loading import parse_overrides
from streamrl.launch import format_summary, run_summary

DEFAULT_STEPS = 16
FLOWS = str(Path(__file__).resolve().parent)


def main(argv: list[str] | None = None) -> int:
    raw = argparse.RawTextHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="learner steps")
    parser.add_argument("--run-uri", default=None, help="default: ./runs/demo-<time>")
    parser.add_argument("--resume", action="store_true", help="resume the run at --run-uri")
    parser.add_argument("--generators", type=int, default=1)
    parser.add_argument("--size", default="smollm2-cpu", help="size preset (tiny-cpu: minutes)")
    parser.add_argument(
        "--env", default=None, help="an environment preset: episodes with tools (calculator)"
    )
    parser.add_argument(
        "--lora", action="store_true", help="train LoRA adapters on the frozen base (preset lora)"
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    if args.resume and not args.run_uri:
        parser.error("--resume needs --run-uri (the run to resume)")
    try:  # before they become a flow run's parameters: a credential never gets that far
        parse_overrides(args.overrides)
    except ConfigError as exc:
        parser.error(str(exc))
    run_uri = args.run_uri or time.strftime("./runs/demo-%Y%m%d-%H%M%S")
    logs = Path(run_uri) / "logs"
    terminal = _terminal_only_for_the_flow(logs / "demo.log")
    env = f", environment {args.env}" if args.env else ""
    env += ", LoRA adapters" if args.lora else ""
    print(f"streamrl demo: DAPO, {args.size}{env}, {args.steps} steps, {args.generators} "
          f"generator(s)\n  run:  {run_uri}\n  logs: {logs}/", file=terminal)  # fmt: skip
    try:
        return _run(args, run_uri, terminal)
    except Exception as exc:  # its traceback is in demo.log; the terminal gets the reason
        logging.getLogger(__name__).exception("the demo failed")
        print(f"demo failed: {exc}\n(details in {logs}/demo.log)", file=terminal)
        return 1


def _run(args: argparse.Namespace, run_uri: str, terminal: IO[str]) -> int:
    try:
        state = streamrl_run(
            preset="dapo",
            size=args.size,
            extra_presets=[*([args.env] if args.env else []), *(["lora"] if args.lora else [])],
            overrides=[f"learner.total_steps={args.steps}", *args.overrides],
            run_uri=run_uri,
            generators=args.generators,
            resume=args.resume,
            return_state=True,
        )
    except KeyboardInterrupt:
        command = shlex.join([sys.executable, "-m", "flows.demo", *_resume_argv(args, run_uri)])
        print("\nstopped: every process of the run has ended; its last checkpoint is intact. "
              f"Resume with:\n  {command}", file=terminal)  # fmt: skip
        return 130
    print(file=terminal)
    print(format_summary(run_summary(open_location(run_uri))), file=terminal)
    if not state.is_completed():
        print(f"demo failed: {state.message}\n(see {run_uri}/logs/)", file=terminal)
        return 1
    return 0


def _resume_argv(args: argparse.Namespace, run_uri: str) -> list[str]:
    """The command line that resumes this demo run."""
    return [
        "--resume",
        "--run-uri",
        run_uri,
        "--steps",
        str(args.steps),
        "--generators",
        str(args.generators),
        "--size",
        args.size,
        *(["--env", args.env] if args.env else []),
        *(["--lora"] if args.lora else []),
        *args.overrides,
    ]


class _FromTheFlow(logging.Filter):
    """Log records of the flow's own code (flows/): its plan, step lines and warnings."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.pathname.startswith(FLOWS)


def _terminal_only_for_the_flow(log_file: Path) -> IO[str]:
    """Send this process's stdout and stderr — and with them those of every process it
    starts that inherits them, such as Prefect's temporary server — to `log_file` for the rest
    of its life; return a stream to the terminal, which also receives the flow's own log
    records (Prefect's logging is configured by now: `flows.run` is imported)."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    terminal = os.fdopen(os.dup(1), "w", buffering=1)
    log = open(log_file, "a", buffering=1)  # noqa: SIM115 (open until the process ends)
    for fd in (1, 2):
        os.dup2(log.fileno(), fd)
    handler = logging.StreamHandler(terminal)
    handler.addFilter(_FromTheFlow())
    handler.setFormatter(_ShortFormatter())
    logging.getLogger("prefect").addHandler(handler)
    return terminal


class _ShortFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.levelno >= logging.WARNING:
            return f"{record.levelname.lower()}: {message}"
        return message


if __name__ == "__main__":
    sys.exit(main())
