"""The `streamrl` command line: the process commands (`generator`, `learner`, `sweep`); `run` is
in `streamrl.cli.run`, `config` and `models` in `streamrl.cli.config`, `eval` and `export` in
`streamrl.cli.evaluate`, `status` and `scale` in `streamrl.cli.status`, `samples` in
`streamrl.cli.samples`, `verify` in `streamrl.cli.verify`, `doctor` in `streamrl.cli.doctor`.

Every command takes the same configuration arguments: `--preset NAME` (repeatable, applied in
order), `--config FILE`, and trailing dotted overrides such as `learner.lr=1e-6`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

from streamrl.cli import config as cli_config
from streamrl.cli import run as cli_run
from streamrl.cli.repeats import RepeatedWarnings
from streamrl.config.base import ConfigError

# The commands a supervisor starts as a run's processes.
COMPONENTS = frozenset({"learner", "generator", "scorer", "eval"})

EXAMPLES_GENERATOR = """\
examples:
  streamrl generator --run ./runs/demo --index 0
  AWS_ENDPOINT_URL=http://127.0.0.1:8333 streamrl generator --run s3://bucket/runs/x --index 3
Joins an existing run (its run.json holds the configuration) and generates until the run's
stop marker appears or SIGTERM arrives; then flushes its open segment and exits 0. One
generator per index: it refuses an index another live generator holds (after waiting up to
30 s for that one's lease to lapse, in case it crashed; exit code 3), and stops, committing
nothing more, if another takes its index over (--take-over; exit code 3). A reward or
environment that cannot be resolved the same way every time (generator.reward.fn or
generator.env.fn names a module, function or class that is not there) exits with code 4 before
vLLM starts, its error line saying what to change: supervisors stop the run instead of
restarting it. So does user code that fails the same way from the start (an agent, environment
or reward failing alike every time it ran in generator.identical_failed_groups_to_stop groups,
every request of an agent refused for the same reason, agents that never sample:
streamrl.generator.failures). One that may load next time (its import raised or timed out)
fails otherwise and is restarted.
"""


def _cmd_generator(args: argparse.Namespace) -> int:
    from storage.control.lease import NOT_HOLDER_EXIT_CODE
    from streamrl.envs import EnvLoadError, EnvResolutionError
    from streamrl.generator.failures import UserCodeFailedError
    from streamrl.generator.index import GeneratorIndexHeldError, GeneratorIndexLostError
    from streamrl.generator.main import run_generator
    from streamrl.rewards import RewardLoadError, RewardResolutionError
    from streamrl.scorers.tokenizers import TokenizerMismatchError
    from streamrl.supervision.policy import USER_CODE_EXIT_CODE

    try:
        stats = run_generator(args.run, args.index, take_over=args.take_over)
    except (GeneratorIndexHeldError, GeneratorIndexLostError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return NOT_HOLDER_EXIT_CODE
    except (RewardResolutionError, EnvResolutionError, TokenizerMismatchError) as exc:
        if isinstance(exc, (RewardLoadError, EnvLoadError)):
            raise  # may load next time: a restart is worth it
        print(f"error: {exc}", file=sys.stderr)
        return USER_CODE_EXIT_CODE
    except UserCodeFailedError as exc:  # its code fails as it would after a restart
        args.repeats.flush()  # the warnings held back, before the line that ends it
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return USER_CODE_EXIT_CODE
    print(f"generator {args.index}: {stats.groups} groups in {stats.segments} segments")
    return 0


EXAMPLES_SCORER = """\
examples:
  streamrl scorer --run ./runs/distil --name teacher
Serves one of the run's scorers (scorers.NAME without a url: a teacher, reward model or judge)
with vLLM's OpenAI-compatible server, and publishes its address in the run's storage once it
answers; `streamrl run` and the flows start it themselves. Exits with the server's code; a
model that is not there, or a teacher whose tokenizer is not the policy's, exits with code 4 (a
restart would fail the same way).
"""


def _cmd_scorer(args: argparse.Namespace) -> int:
    from streamrl.models import ModelPathError
    from streamrl.scorers.serve import serve_scorer
    from streamrl.scorers.tokenizers import TokenizerMismatchError
    from streamrl.supervision.policy import USER_CODE_EXIT_CODE

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    try:
        return serve_scorer(args.run, args.name, stop)
    except (TokenizerMismatchError, ModelPathError) as exc:  # a restart would fail the same way
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)  # one line: the cause
        return USER_CODE_EXIT_CODE


EXAMPLES_LEARNER = """\
examples:
  streamrl learner --run ./runs/demo
  torchrun --nproc_per_node 8 -m -- streamrl learner --run s3://bucket/runs/x
Trains an existing run (its run.json holds the configuration) from its latest checkpoint to
learner.total_steps, then writes the run's stop marker. One learner per run: a learner refuses
a run another live learner holds (exit code 3) and stops, writing nothing more, when another
learner takes the run over (--take-over; exit code 3).
"""


def _say(line: str) -> None:
    """A component's last line, to its supervisor's pipe; a supervisor already gone (its pipe
    closed) must not turn a finished stop into a failure."""
    with contextlib.suppress(OSError):
        print(line, file=sys.stderr, flush=True)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _cmd_learner(args: argparse.Namespace) -> int:
    from storage.control.lease import NOT_HOLDER_EXIT_CODE, LeaseHeldError, LeaseLostError
    from streamrl.data.rows import DatasetError
    from streamrl.learner import run_learner
    from streamrl.learner.stream_source import StopRequested
    from streamrl.learner.topology import exit_process
    from streamrl.supervision.policy import STOPPED_FROM_OUTSIDE, USER_CODE_EXIT_CODE

    # SIGTERM (a supervisor stopping the run) unwinds: the lease is released. With
    # learner.checkpoint_on_stop, run_learner takes SIGTERM over to stop with a checkpoint.
    if args.program:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        _say(f"learner: trained to step {run_learner(args.run, take_over=args.take_over)}")
        code = 0
    except (LeaseHeldError, LeaseLostError) as exc:  # another learner writes this run
        print(f"error: {exc}", file=sys.stderr)  # says DISPLACED: torchrun loses the exit code
        code = NOT_HOLDER_EXIT_CODE
    except StopRequested as exc:  # SIGTERM / Ctrl-C, checkpointed
        _say(f"learner {STOPPED_FROM_OUTSIDE}: {exc}")
        code = 128 + signal.SIGTERM
    except DatasetError as exc:  # a supervised run's conversations: a restart fails the same
        print(f"streamrl: {exc}", file=sys.stderr)
        code = USER_CODE_EXIT_CODE
    except SystemExit as exc:  # SIGTERM
        code = exc.code if isinstance(exc.code, int) else 1
    if args.program:  # this process ends here, without an interpreter teardown to race
        args.repeats.flush()  # the warnings held back: `main` is not returned to
        exit_process(code)
    return code


EXAMPLES_SWEEP = """\
examples:
  streamrl sweep ./runs/mine                    segments older than storage.sweep_grace_s
  streamrl sweep s3://bucket/runs/big --grace-s 600 --dry-run
Deletes replay-stream segments that no commit record names (their writer died before
committing) once they are older than the grace period; committed data is never touched.
A grace shorter than the writers' commit deadline plus a margin is refused (the error names
the minimum): a segment that young may still be committed.
"""


def _cmd_sweep(args: argparse.Namespace) -> int:
    from storage.stream.writer import SweepGraceError, orphan_segments, sweep_orphans
    from streamrl.config.stored import open_existing_run

    config, run = open_existing_run(args.run)
    grace = config.storage.sweep_grace_s if args.grace_s is None else args.grace_s
    try:
        names = (orphan_segments if args.dry_run else sweep_orphans)(run, grace)
    except SweepGraceError as exc:
        given = "--grace-s" if args.grace_s is not None else "storage.sweep_grace_s"
        print(f"streamrl sweep: {exc} ({given})", file=sys.stderr)
        return 2
    if args.dry_run:
        print(f"{len(names)} orphaned segment(s) older than {grace:.0f}s would be removed")
    else:
        print(f"removed {len(names)} orphaned segment(s) older than {grace:.0f}s")
    for name in names:
        print(f"  {name}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamrl",
        description="Asynchronous streaming RL from verifiable rewards.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  streamrl config presets\n  streamrl config show --preset dapo",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    cli_config.add_commands(commands)  # config, models
    raw = argparse.RawDescriptionHelpFormatter

    generator = commands.add_parser(
        "generator",
        help="run one generator of an existing run",
        description="Sample, score and stream groups for an existing run.",
        epilog=EXAMPLES_GENERATOR,
        formatter_class=raw,
    )
    generator.add_argument("--run", required=True, metavar="RUN_URI", help="the run's root URI")
    generator.add_argument(
        "--index", type=int, default=0, help="this generator's index (its data shard)"
    )
    generator.add_argument(
        "--take-over",
        action="store_true",
        help="take the index over at once from the generator holding it, without waiting for "
        "its lease to lapse (that generator then commits nothing more); for a supervisor "
        "restarting the index, or a generator known to be gone",
    )
    generator.set_defaults(func=_cmd_generator)

    scorer = commands.add_parser(
        "scorer",
        help="serve one of a run's scorers (teacher, reward model, judge) with vLLM",
        description="Serve a scorer of an existing run and publish its address.",
        epilog=EXAMPLES_SCORER,
        formatter_class=raw,
    )
    scorer.add_argument("--run", required=True, metavar="RUN_URI", help="the run's root URI")
    scorer.add_argument("--name", required=True, help="the scorer's name (scorers.NAME)")
    scorer.set_defaults(func=_cmd_scorer)

    learner = commands.add_parser(
        "learner",
        help="train an existing run (one rank of a torchrun job)",
        description="Consume the replay stream, train, publish weights and checkpoint.",
        epilog=EXAMPLES_LEARNER,
        formatter_class=raw,
    )
    learner.add_argument("--run", required=True, metavar="RUN_URI", help="the run's root URI")
    learner.add_argument(
        "--take-over",
        action="store_true",
        help="take the run over from the learner that holds its lease, without waiting for "
        "the lease to expire (that learner then writes nothing more); for a learner that is "
        "known to be gone",
    )
    learner.set_defaults(func=_cmd_learner)

    cli_run.add_commands(commands)  # run

    sweep = commands.add_parser(
        "sweep",
        help="delete replay-stream segments of writers that died before committing",
        description="Remove uncommitted (orphaned) stream segments older than a grace period.",
        epilog=EXAMPLES_SWEEP,
        formatter_class=raw,
    )
    sweep.add_argument("run", metavar="RUN_URI", help="the run's root URI")
    sweep.add_argument(
        "--grace-s", type=float, metavar="S", help="age threshold (default storage.sweep_grace_s)"
    )
    sweep.add_argument("--dry-run", action="store_true", help="list, do not delete")
    sweep.set_defaults(func=_cmd_sweep)

    from streamrl.cli import (  # doctor, eval and export, status and scale, verify, samples
        doctor,
        evaluate,
        samples,
        status,
        verify,
        worker_env,
    )

    evaluate.add_commands(commands)
    status.add_commands(commands)
    samples.add_commands(commands)
    verify.add_commands(commands)
    doctor.add_commands(commands)
    worker_env.add_commands(commands)  # worker-env
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # `streamrl config show | head` exits quietly. Only as the program (argv from the command
    # line): a process calling main() as a library keeps Python's SIGPIPE handling, or a write
    # to any dead child's pipe would kill it. Nor a run's component: one whose supervisor died
    # (its output pipe closed) still finishes its stop — a learner its checkpoint.
    args = build_parser().parse_args(argv)
    if argv is None and hasattr(signal, "SIGPIPE") and args.command not in COMPONENTS:
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given, for hints
    args.program = argv is None  # this process is `streamrl ...`, not a library call
    # The same warning over and over is printed once, then counted (`streamrl.cli.repeats`).
    args.repeats = RepeatedWarnings.on(logging.StreamHandler())
    logging.basicConfig(
        level=os.environ.get("STREAMRL_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=[args.repeats.handler],
    )
    from storage.fs import StorageError
    from streamrl.placement import PlacementError
    from streamrl.rewards import RewardResolutionError

    try:
        return args.func(args)
    except (ConfigError, StorageError, RewardResolutionError, PlacementError) as exc:
        print(f"streamrl: {exc}", file=sys.stderr)
        return 2
    finally:
        args.repeats.flush()


if __name__ == "__main__":
    sys.exit(main())
