"""`streamrl run`: a whole run on this machine, supervised without a Prefect server
(`streamrl.supervision.supervisor.Supervisor`), and what its terminal says when it is stopped:
the step a resume starts from, read from the run's storage, and the command that resumes it.

`add_commands(commands)` registers it on the subparsers of `streamrl.cli.main.build_parser`.
"""

from __future__ import annotations

import argparse
import os
import sys

from streamrl.cli.config import add_config_args, config_from

__all__ = ["add_commands"]

EXAMPLES_RUN = """\
examples:
  streamrl run --preset dapo --preset smollm2-cpu storage.run_uri=./runs/demo
  streamrl run --preset dapo --preset tiny-cpu --generators 2 learner.total_steps=20
  streamrl run --resume --preset dapo --preset smollm2-cpu storage.run_uri=./runs/demo \\
      learner.total_steps=40                 extend a finished run by 20 steps
A whole run on this machine without a Prefect server: the learner, the generators and the
evaluator as subprocesses. Nothing starts before the configuration is valid and the modules
its import paths name are found. A crashed generator is restarted (--max-restarts); one whose
reward or environment cannot be resolved (exit code 4) stops the run at once. The run ends when
the learner reaches learner.total_steps. Each process's output goes to <run>/logs/ (local runs)
or ./streamrl-logs/, copied to <run>/logs/<host>/ (runs on S3); the console shows learner steps,
warnings and errors.
"""


def _cmd_run(args: argparse.Namespace) -> int:
    from streamrl.config.stored import prepare_run
    from streamrl.envs.prerequisites import check_prerequisites
    from streamrl.isolation.user_code import check_user_code
    from streamrl.placement import plan_placement
    from streamrl.runs.summary import format_summary, resume_point
    from streamrl.runs.summary import run_summary as summarize
    from streamrl.supervision.output import noteworthy
    from streamrl.supervision.supervisor import (
        ComponentFailedError,
        RunInterruptedError,
        Supervisor,
    )

    config = config_from(args)
    count = config.generators_to_start(args.generators)
    placement = plan_placement(config, generators=count)  # refused before anything starts
    check_user_code(config.user_code)  # a misspelt module too
    check_prerequisites(config.data, config.generator.env)  # reasoning-gym, worker envs
    config, run = prepare_run(
        config, resume=args.resume, allow_trusted_changes=args.allow_trusted_changes
    )

    def on_line(component: str, line: str) -> None:
        if (shown := noteworthy(line)) is not None:
            print(f"[{component}] {shown}", flush=True)

    supervisor = Supervisor.for_run(
        config, generators=count, on_line=on_line, placement=placement,
        max_restarts=args.max_restarts,
    )  # fmt: skip
    print(f"streamrl run: {run.uri} — learner + {count} generator(s)"
          f"{f' ({config.learner_only})' if config.learner_only else ''}; logs in "
          f"{supervisor.logs.folder}", flush=True)  # fmt: skip
    print(placement.describe(), flush=True)
    try:
        supervisor.run()
    except ComponentFailedError as exc:
        print(f"streamrl run failed: {exc}", file=sys.stderr)
        return 1
    except RunInterruptedError as exc:
        try:
            where = resume_point(run)
        except Exception as error:  # storage unreachable now: say so, not a traceback
            where = f"where a resume starts could not be read ({error!r})"
        print(f"\nstreamrl run: stopped ({exc}); every process of the run has ended; "
              f"{where}. Resume with:\n  {_resume_command(args)}", file=sys.stderr)  # fmt: skip
        return 130
    print(format_summary(summarize(run)))
    return 0


def _resume_command(args: argparse.Namespace) -> str:
    """The command line that resumes a stopped `streamrl run`, as given plus `--resume`; with
    the `PYTHONPATH` it ran under (each folder made absolute), so a run whose reward, agent or
    environment lives in the user's package resumes from any folder."""
    import shlex

    given = [a for a in args.argv if a != "--resume"]
    at = given.index("run") + 1
    command = shlex.join(["streamrl", *given[:at], "--resume", *given[at:]])
    if path := os.environ.get("PYTHONPATH"):
        folders = os.pathsep.join(
            os.path.abspath(p) if p else os.getcwd() for p in path.split(os.pathsep)
        )
        command = f"PYTHONPATH={shlex.quote(folders)} {command}"
    return command


def add_commands(commands: argparse._SubParsersAction) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    run = commands.add_parser(
        "run",
        help="a whole run on this machine, without a Prefect server",
        description="Create (or resume) a run and supervise its learner and generators.",
        epilog=EXAMPLES_RUN,
        formatter_class=raw,
    )
    add_config_args(run)
    run.add_argument("--resume", action="store_true", help="resume the run at storage.run_uri")
    run.add_argument(
        "--allow-trusted-changes",
        action="store_true",
        help="with --resume: let fields that decide what code runs or what is trusted change "
        "(generator.reward.fn, model.path, model.trust_remote_code, storage.endpoint_url, "
        "placement.env, ...: streamrl.config.stored.TRUSTED_FIELDS); refused without it",
    )
    run.add_argument(
        "--generators", type=int, metavar="N", help="generators to start (default generator.count)"
    )
    run.add_argument(
        "--max-restarts", type=int, default=3, metavar="N", help="restarts per generator"
    )
    run.set_defaults(func=_cmd_run)
