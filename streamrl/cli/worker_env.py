"""`streamrl worker-env verifiers|openenv`: create the worker environment a verifiers
environment (`generator.env.verifiers`) or an OpenEnv server the generator starts
(`generator.env.openenv.app`) runs in (`streamrl.envs.worker_envs`).

    streamrl worker-env verifiers --package my-env            # verifiers 0.3.1 + my-env
    streamrl worker-env verifiers --version 0.3.1 --path ./venvs/vf --package ./environments/x
    streamrl worker-env openenv --package ./envs/my_env       # openenv-core 0.3.0, uvicorn

Creates a virtualenv (or adds to an existing one) and pip-installs the tool at `--version` and
each `--package` into it; prints where it is, which `generator.env.verifiers.worker_env` /
`generator.env.openenv.python` names unless it is the default location.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from streamrl.envs.worker_envs import WORKER_ENV_TOOLS, create_worker_env, default_worker_env

__all__ = ["add_commands"]


def add_commands(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    worker_env = commands.add_parser(
        "worker-env",
        help="create the virtualenv a verifiers environment or an OpenEnv server runs in",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    worker_env.add_argument("tool", choices=sorted(WORKER_ENV_TOOLS))
    worker_env.add_argument("--version", default=None, help="default: the tool's tested one")
    worker_env.add_argument("--path", type=Path, default=None, help="default: the user's cache")
    worker_env.add_argument(
        "--package", action="append", default=[], help="a pip requirement or path (repeatable)"
    )
    worker_env.set_defaults(func=_cmd_worker_env)


def _cmd_worker_env(args: argparse.Namespace) -> int:
    version = args.version or WORKER_ENV_TOOLS[args.tool][0]
    location = args.path or default_worker_env(args.tool, version)
    try:
        python = create_worker_env(location, version, args.package, args.tool)
    except (OSError, subprocess.CalledProcessError) as error:
        print(f"error: the worker environment at {location} could not be made: {error}")
        return 1
    print(f"ok    worker environment {location} (python {python})")
    return 0
