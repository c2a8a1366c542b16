"""`streamrl worker-env verifiers`: create the worker environment a verifiers environment runs
in (`generator.env.verifiers`; `streamrl.envs.worker_envs`).

    streamrl worker-env verifiers --package my-env            # verifiers 0.3.1 + my-env
    streamrl worker-env verifiers --version 0.3.1 --path ./venvs/vf --package ./environments/x

Creates a virtualenv (or adds to an existing one) and pip-installs `verifiers==<version>` and
each `--package` into it; prints where it is, which `generator.env.verifiers.worker_env` names
unless it is the default location.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from streamrl.envs.verifiers_config import DEFAULT_VERIFIERS_VERSION
from streamrl.envs.worker_envs import create_worker_env, default_worker_env

__all__ = ["add_commands"]


def add_commands(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    worker_env = commands.add_parser(
        "worker-env",
        help="create the virtualenv a verifiers environment runs in",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    worker_env.add_argument("tool", choices=["verifiers"])
    worker_env.add_argument("--version", default=DEFAULT_VERIFIERS_VERSION)
    worker_env.add_argument("--path", type=Path, default=None, help="default: the user's cache")
    worker_env.add_argument(
        "--package", action="append", default=[], help="a pip requirement or path (repeatable)"
    )
    worker_env.set_defaults(func=_cmd_worker_env)


def _cmd_worker_env(args: argparse.Namespace) -> int:
    location = args.path or default_worker_env(args.tool, args.version)
    try:
        python = create_worker_env(location, args.version, args.package)
    except (OSError, subprocess.CalledProcessError) as error:
        print(f"error: the worker environment at {location} could not be made: {error}")
        return 1
    print(f"ok    worker environment {location} (python {python})")
    return 0
