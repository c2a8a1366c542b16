"""`make demo`: a DAPO run of SmolLM2-135M-Instruct on the bundled arithmetic problems, on this
machine, through the `streamrl` flow with Prefect's temporary local server (no separate server
to start). The run lives under ./runs/; the end prints reward and accuracy before and after.

    python -m flows.demo [--steps N] [--run-uri DIR] [--resume] [--generators N] [KEY=VALUE ...]
    python -m flows.demo --recipe calculator-agent [--run-uri DIR] [--resume] [KEY=VALUE ...]

With `--recipe`, the demo is a training recipe (`flows.recipe`: a supervised warm start, RL, an
evaluation, an export; each stage a child flow run in a folder of its own under the run URI),
each stage announced, then its step lines; the end prints each run stage's summary and the
evaluation.

The terminal shows a short header (the run, where its logs are), a line while Prefect's
temporary server starts (given `TEMPORARY_SERVER_SETTINGS`: up to 3 minutes, its analytics off),
the placement plan, the processes' progress before the first step (an engine up, the first
groups committed, a learner still waiting), then one line per learner step and streamrl's
warnings.
Everything else — Prefect's server and engine messages, vLLM's and torch's start-up output —
goes to `<run>/logs/demo.log` (each process's own output to `<run>/logs/<process>.log`).
Ctrl-C stops every process of the run; the last checkpoint stays intact and the terminal says
how to resume. (The flow runs in a child process of a session of its own, which the command
passes Ctrl-C to: `_flow_in_a_session_of_its_own`.)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO

DEFAULT_STEPS = 16
FLOWS = str(Path(__file__).resolve().parent)
_FLOW_PROCESS = "STREAMRL_DEMO_FLOW_PROCESS"  # set in the process that runs the flow
TEMPORARY_SERVER_SETTINGS = {
    # Prefect gives its temporary server 20 s to answer, and a busy machine can take a minute:
    # the demo would fail before it began ("Timed out while attempting to connect to ephemeral
    # Prefect API server").
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    # Its telemetry, a write to its SQLite database as it starts, can hold the database while
    # the flow's first calls wait ("database is locked"); it also sends data off this machine.
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
}
"""Prefect settings of the process that runs the flow and starts the temporary server, where
the user's environment sets none (`flow_environment`)."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    args = parser.parse_args(argv)
    if args.resume and not args.run_uri:
        parser.error("--resume needs --run-uri (the run to resume)")
    if os.environ.get(_FLOW_PROCESS) != "1":
        if not args.run_uri:  # chosen once, here: the child's clock may have moved on
            name = f"recipe-{args.recipe}" if args.recipe else "demo"
            argv = ["--run-uri", time.strftime(f"./runs/{name}-%Y%m%d-%H%M%S"), *argv]
        return _flow_in_a_session_of_its_own(argv)
    # The command passes Ctrl-C on as SIGINT: stop on it even if this process was started with
    # SIGINT ignored, as a shell starts a command in the background.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import flows.run  # noqa: F401  (Prefect configures its logging on import: before the split)
    from streamrl.config.base import ConfigError
    from streamrl.config.loading import parse_overrides

    try:  # before they become a flow run's parameters: a credential never gets that far
        parse_overrides(args.overrides)
    except ConfigError as exc:
        parser.error(str(exc))
    logs = Path(args.run_uri) / "logs"
    terminal = _terminal_only_for_the_flow(logs / "demo.log")
    if args.recipe:
        print(f"streamrl demo: recipe {args.recipe}\n  root: {args.run_uri}\n  logs: {logs}/ "
              "and each stage's <root>/<stage>/logs/", file=terminal)  # fmt: skip
        _say_the_server_starts(terminal)
        try:
            return _run_recipe(args, terminal)
        except Exception as exc:
            logging.getLogger(__name__).exception("the demo failed")
            print(f"demo failed: {exc}\n(details in {logs}/demo.log)", file=terminal)
            return 1
    env = f", task {args.task}" if args.task else ""
    env += f", environment {args.env}" if args.env else ""
    env += ", LoRA adapters" if args.lora else ""
    print(f"streamrl demo: DAPO, {args.size}{env}, {args.steps} steps, {args.generators} "
          f"generator(s)\n  run:  {args.run_uri}\n  logs: {logs}/", file=terminal)  # fmt: skip
    _say_the_server_starts(terminal)
    try:
        return _run(args, terminal)
    except Exception as exc:  # its traceback is in demo.log; the terminal gets the reason
        logging.getLogger(__name__).exception("the demo failed")
        print(f"demo failed: {exc}\n(details in {logs}/demo.log)", file=terminal)
        return 1


def _parser() -> argparse.ArgumentParser:
    raw = argparse.RawTextHelpFormatter
    parser = argparse.ArgumentParser(prog="flows.demo", description=__doc__, formatter_class=raw)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="learner steps")
    parser.add_argument("--run-uri", default=None, help="default: ./runs/demo-<time>")
    parser.add_argument("--resume", action="store_true", help="resume the run at --run-uri")
    parser.add_argument("--generators", type=int, default=1)
    parser.add_argument("--size", default="smollm2-cpu", help="size preset (tiny-cpu: minutes)")
    parser.add_argument(
        "--task",
        default=None,
        help="a task preset: its data and reward (code: Python problems; reasoning-gym: a "
        "mixture of reasoning-gym tasks)",
    )
    parser.add_argument(
        "--env",
        default=None,
        help="an environment preset: episodes with tools (calculator), a code agent "
        "(code_feedback, with --task code)",
    )
    parser.add_argument(
        "--lora", action="store_true", help="train LoRA adapters on the frozen base (preset lora)"
    )
    parser.add_argument(
        "--recipe",
        default=None,
        help="a training recipe instead of one run: calculator-agent (SFT, RL, eval, export), "
        "sft-dpo-rl (SFT, DPO, RL, eval, export) or a recipe's YAML file",
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    return parser


def _flow_in_a_session_of_its_own(argv: list[str]) -> int:
    """Run the demo in a child process of a session of its own, pass it the terminal's Ctrl-C
    (and a closed terminal's hang-up, or SIGTERM, as one) and return its exit code.

    A terminal sends Ctrl-C to every process of its foreground process group. Prefect's
    temporary server, started by the flow's process, would be one of them and stop at once,
    while the flow still has to stop the run's components and report its end to that server;
    it would then wait for a server that is gone. In the child's session the server is stopped
    only by the flow, at its end (and the components, each in a session of its own, only by
    the flow's supervisor)."""
    child = subprocess.Popen(
        [sys.executable, "-m", "flows.demo", *argv],
        env=flow_environment(os.environ),
        start_new_session=True,
    )

    def forward(signum: int, frame: object) -> None:
        if not stopping:
            print(
                "\nstopping: generators commit what they sampled; the learner finishes the step "
                "in hand and checkpoints it (within learner.stop_grace_s)",
                flush=True,
            )
        stopping.append(signum)
        child.send_signal(signal.SIGINT)

    stopping: list[int] = []

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    code = child.wait()
    return code if code >= 0 else 128 - code  # a child killed by signal N: 128 + N, as a shell


def flow_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of the process that runs the flow: `environ` with the temporary
    server's settings (`TEMPORARY_SERVER_SETTINGS`) where it has none of its own."""
    return {**TEMPORARY_SERVER_SETTINGS, **environ, _FLOW_PROCESS: "1"}


def _say_the_server_starts(terminal: IO[str]) -> None:
    """Prefect's temporary server starts with the flow's first call to its API, before any
    line of the run: say so, unless a server is configured (`PREFECT_API_URL`)."""
    from prefect.settings import get_current_settings

    if not get_current_settings().api.url:
        print("starting Prefect's temporary server (can take a minute on a busy machine)...",
              file=terminal)  # fmt: skip


def _run(args: argparse.Namespace, terminal: IO[str]) -> int:
    from flows.run import streamrl_run
    from storage.fs import open_location
    from streamrl.runs.summary import format_summary, resume_point, run_summary

    run_uri = args.run_uri
    try:
        state = streamrl_run(
            preset="dapo",
            size=args.size,
            extra_presets=[
                *([args.task] if args.task else []),
                *([args.env] if args.env else []),
                *(["lora"] if args.lora else []),
            ],
            overrides=[f"learner.total_steps={args.steps}", *args.overrides],
            run_uri=run_uri,
            generators=args.generators,
            resume=args.resume,
            return_state=True,
        )
    except KeyboardInterrupt:
        command = shlex.join([sys.executable, "-m", "flows.demo", *_resume_argv(args, run_uri)])
        resume_at = resume_point(open_location(run_uri))
        print(f"\nstopped: every process of the run has ended; {resume_at}. "
              f"Resume with:\n  {command}", file=terminal)  # fmt: skip
        return 130
    print(file=terminal)
    print(format_summary(run_summary(open_location(run_uri))), file=terminal)
    if not state.is_completed():
        print(f"demo failed: {state.message}\n(see {run_uri}/logs/)", file=terminal)
        return 1
    return 0


def _run_recipe(args: argparse.Namespace, terminal: IO[str]) -> int:
    from flows.recipe import eval_line, recipe
    from storage.fs import open_location
    from streamrl.recipes import EVAL_RESULT, RunStage, load_recipe, plan_recipe
    from streamrl.runs.summary import format_summary, run_summary

    try:
        state = recipe(
            name=args.recipe,
            root=args.run_uri,
            overrides=args.overrides,
            resume=args.resume,
            return_state=True,
        )
    except KeyboardInterrupt:
        argv = ["--recipe", args.recipe, "--resume", "--run-uri", args.run_uri, *args.overrides]
        command = shlex.join([sys.executable, "-m", "flows.demo", *argv])
        print(f"\nstopped: every process of the stage has ended; finished stages are kept and "
              f"the running one resumes from its checkpoint. Resume with:\n  {command}",
              file=terminal)  # fmt: skip
        return 130
    name, spec = load_recipe(args.recipe)
    plan = plan_recipe(name, spec, args.run_uri, overrides=args.overrides)
    for step in plan.stages:
        if isinstance(step.stage, RunStage) and Path(step.uri, "metrics").exists():
            print(f"\nstage {step.name}:", file=terminal)
            print(format_summary(run_summary(open_location(step.uri))), file=terminal)
        elif Path(step.uri, EVAL_RESULT).exists():
            metrics = json.loads(Path(step.uri, EVAL_RESULT).read_text())
            shown = eval_line(metrics)
            print(f"\nstage {step.name}: v{metrics.get('version')}  {shown}", file=terminal)
    if not state.is_completed():
        print(f"demo failed: {state.message}\n(see {args.run_uri}/)", file=terminal)
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
        *(["--task", args.task] if args.task else []),
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
