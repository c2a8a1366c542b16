"""`streamrl config` and `streamrl models`: show, validate and document configurations; list
and prepare the bundled models. Also the configuration arguments every run command takes
(`add_config_args`, `config_from`).

`add_commands(commands)` registers both on the subparsers of `streamrl.cli.main.build_parser`.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from typing import Any

from pydantic import BaseModel

from streamrl.algorithms.policy_losses import POLICY_LOSSES
from streamrl.algorithms.preference_config import PreferenceConfig
from streamrl.config.base import ConfigError
from streamrl.config.loading import UNIONS, available_presets, load_config
from streamrl.config.run import RunConfig
from streamrl.envs.config import EnvConfig
from streamrl.isolation.user_code import check_user_code, modules_not_found
from streamrl.learner.config import SupervisedConfig
from streamrl.models.config import CriticConfig
from streamrl.rewards.config import RewardConfig
from streamrl.scorers.config import ScorerConfig
from streamrl.scorers.terms import JudgeTerm, RewardModelTerm

__all__ = ["add_commands", "add_config_args", "config_from"]

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
Checks every field and rule, and that the top-level module of each import path
(generator.reward.fn, generator.env.fn) is found on this machine (without importing it; with
placement.mode=pools only noted: the pools' workers import it).
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


def add_config_args(parser: argparse.ArgumentParser) -> None:
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


def config_from(args: argparse.Namespace) -> RunConfig:
    return load_config(args.preset, args.config, args.overrides)


def _cmd_show(args: argparse.Namespace) -> int:
    print(config_from(args).to_yaml(), end="")
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    config = config_from(args)
    if config.placement.runs_here:
        check_user_code(config.user_code)
    else:  # the pools' workers import it, in their image: this machine may well lack it
        for problem in modules_not_found(config.user_code):
            print(f"note: on this machine, {problem}; the work pools' workers import it, "
                  "from placement.image", file=sys.stderr)  # fmt: skip
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
        if field.is_required():
            lines.append(f"{prefix}.{name} = (required)")
            if field.description:
                lines.append(f"    {field.description}")
            continue
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
        elif name == "scorers":  # sections by name, each a ScorerConfig
            sections["scorers.<name>"] = ScorerConfig
        elif name == "sft":  # optional: set, a supervised run
            sections["sft"] = SupervisedConfig
        elif name == "preference":  # optional: set, a preference run
            sections["preference"] = PreferenceConfig
        else:
            sections[name] = field.annotation  # type: ignore[assignment]
    sections["generator.reward"] = RewardConfig
    sections["generator.reward.models.<name>.reward_model"] = RewardModelTerm
    sections["generator.reward.models.<name>.judge"] = JudgeTerm
    sections["generator.env"] = EnvConfig
    sections["model.critic"] = CriticConfig
    sections.update({f"algorithm.policy_loss.{k}": v for k, v in POLICY_LOSSES.items()})
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


def add_commands(commands: Any) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    config = commands.add_parser(
        "config",
        help="show, validate and document configurations",
        description="Show, validate and document run configurations.",
    )
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")

    show = config_commands.add_parser(
        "show",
        help="print the resolved configuration as YAML",
        epilog=EXAMPLES_SHOW,
        formatter_class=raw,
    )
    add_config_args(show)
    show.set_defaults(func=_cmd_show)

    validate = config_commands.add_parser(
        "validate",
        help="check a configuration and report every problem",
        epilog=EXAMPLES_VALIDATE,
        formatter_class=raw,
    )
    add_config_args(validate)
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
