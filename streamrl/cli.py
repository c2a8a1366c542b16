"""The `streamrl` command line.

Every command takes the same configuration arguments: `--preset NAME` (repeatable, applied in
order), `--config FILE`, and trailing dotted overrides such as `learner.lr=1e-6`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from importlib import resources

from pydantic import BaseModel

from streamrl.config import RunConfig
from streamrl.config_base import ConfigError
from streamrl.config_loading import UNIONS, available_presets, load_config
from streamrl.models.config import CriticConfig
from streamrl.rewards.config import RewardConfig

EXAMPLES_SHOW = """\
examples:
  streamrl config show --preset dapo --preset tiny-cpu
  streamrl config show --preset vapo learner.lr=2e-6 generator.group_size=16
  streamrl config show --config my-run.yaml algorithm.clip_high=0.3
"""

EXAMPLES_VALIDATE = """\
examples:
  streamrl config validate --config my-run.yaml
  streamrl config validate --preset qwen2.5-7b-dapo learner.total_steps=500
exit status: 0 when valid, 2 with one line per problem otherwise.
"""

EXAMPLES_MODELS = """\
examples:
  streamrl models list
  streamrl models prepare                    every bundled model
  streamrl models prepare tiny-qwen2
  STREAMRL_CACHE=/data/cache streamrl models prepare smollm2-135m-instruct
The cache is $STREAMRL_CACHE, else ~/.cache/streamrl; --cache-dir overrides both.
"""

EXAMPLES_FIELDS = """\
examples:
  streamrl config fields              every section
  streamrl config fields learner      one section
  streamrl config fields algorithm.vapo
"""


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset",
        "-p",
        action="append",
        default=[],
        metavar="NAME",
        help="preset to apply (repeatable, in order): an algorithm (dapo, vapo, grpo, ...) "
        "and/or a size (tiny-cpu, smollm2-cpu, ...)",
    )
    parser.add_argument("--config", "-c", metavar="FILE", help="YAML configuration file")
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. learner.lr=1e-6"
    )


def _config_from(args: argparse.Namespace) -> RunConfig:
    return load_config(args.preset, args.config, args.overrides)


def _cmd_show(args: argparse.Namespace) -> int:
    print(_config_from(args).to_yaml(), end="")
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    config = _config_from(args)
    print(
        f"ok: algorithm {config.algorithm.name}, model {config.model.path}, run {config.run_name}"
    )
    return 0


def _preset_summary(name: str) -> str:
    text = (resources.files("streamrl") / "presets" / f"{name}.yaml").read_text()
    comments = [line.lstrip("# ").strip() for line in text.splitlines() if line.startswith("#")]
    return comments[0] if comments else ""


def _cmd_presets(args: argparse.Namespace) -> int:
    names = available_presets()
    width = max(len(n) for n in names)
    for name in names:
        print(f"{name:<{width}}  {_preset_summary(name)}")
    return 0


def _describe_model(model: type[BaseModel], prefix: str) -> list[str]:
    lines = []
    # A union member's defaults are its own (each algorithm's paper values).
    instance = model() if prefix.split(".")[0] in UNIONS else None
    for name, field in model.model_fields.items():
        default = (
            getattr(instance, name)
            if instance is not None
            else field.get_default(call_default_factory=True)
        )
        if isinstance(default, BaseModel):
            default = default.model_dump()
        lines.append(f"{prefix}.{name} = {default!r}")
        if field.description:
            lines.append(f"    {field.description}")
    return lines


def _cmd_fields(args: argparse.Namespace) -> int:
    sections: dict[str, type[BaseModel]] = {}
    for name, field in RunConfig.model_fields.items():
        if name in UNIONS:
            sections.update({f"{name}.{k}": v for k, v in UNIONS[name][1].items()})
        else:
            sections[name] = field.annotation  # type: ignore[assignment]
    sections["generator.reward"] = RewardConfig
    sections["model.critic"] = CriticConfig
    wanted = [s for s in sections if args.section is None or s.startswith(args.section)]
    if not wanted:
        raise ConfigError(
            [f"unknown section {args.section!r}; choose one of: {', '.join(sections)}"]
        )
    for section in wanted:
        print(f"[{section}]")
        print("\n".join(_describe_model(sections[section], section)))
        print()
    return 0


def _cmd_models_list(args: argparse.Namespace) -> int:
    from streamrl.models import BUNDLED_MODELS, is_prepared, model_dir

    width = max(len(n) for n in BUNDLED_MODELS)
    for name, model in BUNDLED_MODELS.items():
        where = model_dir(name, args.cache_dir)
        state = f"prepared at {where}" if is_prepared(name, args.cache_dir) else "not prepared"
        print(f"{name:<{width}}  {model.description}\n{'':<{width}}  {state}")
    return 0


def _cmd_models_prepare(args: argparse.Namespace) -> int:
    from streamrl.models import BUNDLED_MODELS, prepare_model

    for name in args.names or list(BUNDLED_MODELS):
        print(f"{name}: {prepare_model(name, args.cache_dir)}", flush=True)
    return 0


EXAMPLES_GENERATOR = """\
examples:
  streamrl generator --run ./runs/demo --index 0
  AWS_ENDPOINT_URL=http://127.0.0.1:8333 streamrl generator --run s3://bucket/runs/x --index 3
Joins an existing run (its run.json holds the configuration) and generates until the run's
stop marker appears or SIGTERM arrives; then flushes its open segment and exits 0. One
generator per index: it refuses an index another live generator holds (after waiting up to
30 s for that one's lease to lapse, in case it crashed; exit code 3), and stops, committing
nothing more, if another takes its index over (--take-over; exit code 3).
"""


def _cmd_generator(args: argparse.Namespace) -> int:
    from storage.lease import NOT_HOLDER_EXIT_CODE
    from streamrl.generator.main import run_generator
    from streamrl.launch import GeneratorIndexHeldError, GeneratorIndexLostError

    try:
        stats = run_generator(args.run, args.index, take_over=args.take_over)
    except (GeneratorIndexHeldError, GeneratorIndexLostError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return NOT_HOLDER_EXIT_CODE
    print(f"generator {args.index}: {stats.groups} groups in {stats.segments} segments")
    return 0


EXAMPLES_LEARNER = """\
examples:
  streamrl learner --run ./runs/demo
  torchrun --nproc_per_node 8 -m -- streamrl learner --run s3://bucket/runs/x
Trains an existing run (its run.json holds the configuration) from its latest checkpoint to
learner.total_steps, then writes the run's stop marker. One learner per run: a learner refuses
a run another live learner holds (exit code 3) and stops, writing nothing more, when another
learner takes the run over (--take-over; exit code 3).
"""


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _cmd_learner(args: argparse.Namespace) -> int:
    from storage.lease import NOT_HOLDER_EXIT_CODE, LeaseHeldError, LeaseLostError
    from streamrl.learner import run_learner
    from streamrl.learner.topology import exit_process

    if args.program:  # SIGTERM (a supervisor stopping the run) unwinds: the lease is released
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        print(f"learner: trained to step {run_learner(args.run, take_over=args.take_over)}")
        code = 0
    except (LeaseHeldError, LeaseLostError) as exc:  # another learner writes this run
        print(f"error: {exc}", file=sys.stderr)  # says DISPLACED: torchrun loses the exit code
        code = NOT_HOLDER_EXIT_CODE
    except SystemExit as exc:  # SIGTERM
        code = exc.code if isinstance(exc.code, int) else 1
    if args.program:  # this process ends here, without an interpreter teardown to race
        exit_process(code)
    return code


EXAMPLES_RUN = """\
examples:
  streamrl run --preset dapo --preset smollm2-cpu storage.run_uri=./runs/demo
  streamrl run --preset dapo --preset tiny-cpu --generators 2 learner.total_steps=20
  streamrl run --resume --preset dapo --preset smollm2-cpu storage.run_uri=./runs/demo \\
      learner.total_steps=40                 extend a finished run by 20 steps
A whole run on this machine without a Prefect server: the learner, the generators and the
evaluator as subprocesses. A crashed generator is restarted (--max-restarts); the run ends when
the learner reaches learner.total_steps. Each process's output goes to <run>/logs/ (local runs)
or ./streamrl-logs/; the console shows learner steps, warnings and errors.
"""


def _cmd_run(args: argparse.Namespace) -> int:
    import shlex

    from streamrl.component_output import noteworthy
    from streamrl.launch import format_summary
    from streamrl.launch import run_summary as summarize
    from streamrl.placement import plan_placement
    from streamrl.runs import prepare_run
    from streamrl.supervisor import ComponentFailedError, RunInterruptedError, Supervisor

    config = _config_from(args)
    count = args.generators or config.generator.count
    placement = plan_placement(config, generators=count)  # refused before anything starts
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
    print(f"streamrl run: {run.uri} — learner + {count} generator(s); logs in "
          f"{supervisor.logs.folder}", flush=True)  # fmt: skip
    print(placement.describe(), flush=True)
    try:
        supervisor.run()
    except ComponentFailedError as exc:
        print(f"streamrl run failed: {exc}", file=sys.stderr)
        return 1
    except RunInterruptedError:
        given = [a for a in args.argv if a != "--resume"]
        at = given.index("run") + 1
        command = shlex.join(["streamrl", *given[:at], "--resume", *given[at:]])
        print(f"\nstreamrl run: stopped; every process of the run has ended, its last "
              f"checkpoint is intact. Resume with:\n  {command}", file=sys.stderr)  # fmt: skip
        return 130
    print(format_summary(summarize(run)))
    return 0


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
    from storage.stream import SweepGraceError, orphan_segments, sweep_orphans
    from streamrl.runs import open_existing_run

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

    config = commands.add_parser(
        "config",
        help="show, validate and document configurations",
        description="Show, validate and document run configurations.",
    )
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    raw = argparse.RawDescriptionHelpFormatter

    show = config_commands.add_parser(
        "show",
        help="print the resolved configuration as YAML",
        epilog=EXAMPLES_SHOW,
        formatter_class=raw,
    )
    _add_config_args(show)
    show.set_defaults(func=_cmd_show)

    validate = config_commands.add_parser(
        "validate",
        help="check a configuration and report every problem",
        epilog=EXAMPLES_VALIDATE,
        formatter_class=raw,
    )
    _add_config_args(validate)
    validate.set_defaults(func=_cmd_validate)

    presets = config_commands.add_parser(
        "presets",
        help="list the bundled presets",
        epilog="example:\n  streamrl config presets",
        formatter_class=raw,
    )
    presets.set_defaults(func=_cmd_presets)

    fields = config_commands.add_parser(
        "fields",
        help="document every field with its default",
        epilog=EXAMPLES_FIELDS,
        formatter_class=raw,
    )
    fields.add_argument("section", nargs="?", help="section prefix, e.g. learner or algorithm.dapo")
    fields.set_defaults(func=_cmd_fields)

    models = commands.add_parser(
        "models",
        help="list and prepare the bundled models",
        description="Build the bundled models into the local cache (no model hub needed).",
        epilog=EXAMPLES_MODELS,
        formatter_class=raw,
    )
    models_commands = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    models_list = models_commands.add_parser(
        "list", help="list the bundled models and whether they are prepared"
    )
    models_list.set_defaults(func=_cmd_models_list)
    models_prepare = models_commands.add_parser(
        "prepare", help="build bundled models into the cache and print their directories"
    )
    models_prepare.add_argument(
        "names", nargs="*", metavar="NAME", help="bundled models to prepare (default: all)"
    )
    models_prepare.set_defaults(func=_cmd_models_prepare)
    for command in (models_list, models_prepare):
        command.add_argument(
            "--cache-dir",
            metavar="DIR",
            help="cache root (default: $STREAMRL_CACHE, else ~/.cache/streamrl)",
        )

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

    run = commands.add_parser(
        "run",
        help="a whole run on this machine, without a Prefect server",
        description="Create (or resume) a run and supervise its learner and generators.",
        epilog=EXAMPLES_RUN,
        formatter_class=raw,
    )
    _add_config_args(run)
    run.add_argument("--resume", action="store_true", help="resume the run at storage.run_uri")
    run.add_argument(
        "--allow-trusted-changes",
        action="store_true",
        help="with --resume: let fields that decide what code runs or what is trusted change "
        "(generator.reward.fn, model.path, model.trust_remote_code, storage.endpoint_url, "
        "placement.env, ...: streamrl.runs.TRUSTED_FIELDS); refused without it",
    )
    run.add_argument(
        "--generators", type=int, metavar="N", help="generators to start (default generator.count)"
    )
    run.add_argument(
        "--max-restarts", type=int, default=3, metavar="N", help="restarts per generator"
    )
    run.set_defaults(func=_cmd_run)

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

    from streamrl import cli_eval, cli_status  # their own modules: eval, export, status

    cli_eval.add_commands(commands)
    cli_status.add_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # `streamrl config show | head` exits quietly. Only as the program (argv from the command
    # line): a process calling main() as a library keeps Python's SIGPIPE handling, or a write
    # to any dead child's pipe would kill it.
    if argv is None and hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given, for hints
    args.program = argv is None  # this process is `streamrl ...`, not a library call
    logging.basicConfig(
        level=os.environ.get("STREAMRL_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from storage.fs import StorageError
    from streamrl.placement import PlacementError
    from streamrl.rewards import RewardResolutionError

    try:
        return args.func(args)
    except (ConfigError, StorageError, RewardResolutionError, PlacementError) as exc:
        print(f"streamrl: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
