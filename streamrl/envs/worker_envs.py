"""Worker environments: virtualenvs of their own for ecosystem code that brings its own
dependency set. verifiers 0.3.1 pulls in pandas 3, datasets 5, mcp, anthropic, the
openai-agents SDK and Prime Intellect's prime-* packages, and each user's environment package
adds its own; installed beside streamrl they would move versions streamrl was tested with
(torch, vLLM, openai, pandas), and differ from one environment to the next. So they live
apart, and streamrl's interpreter never imports them: it runs the worker environment's
interpreter on a self-contained script (`streamrl.envs.verifiers_runner`) and talks to it over
a pipe.

A worker environment lives at `generator.env.verifiers.worker_env`, by default
`<cache>/streamrl/worker-envs/verifiers-<version>` (`<cache>`: `$XDG_CACHE_HOME`, else
`~/.cache`). `streamrl worker-env verifiers --package <your env package>` creates it
(`python -m venv`, then `pip install verifiers==<version> <packages>`); `check_verifiers_env`
refuses a missing one before a generator starts, naming that command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

__all__ = [
    "WORKER_ENV_TOOLS",
    "create_worker_env",
    "default_interpreter",
    "default_worker_env",
    "interpreter",
    "worker_env_command",
]

_PROBE = """
import importlib.metadata, importlib.util, json, sys
try:
    version = importlib.metadata.version("verifiers")
except importlib.metadata.PackageNotFoundError:
    version = None
module = sys.argv[1].rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_")
print(json.dumps({"verifiers": version, "module": importlib.util.find_spec(module) is not None}))
"""
PROBE_TIMEOUT_S = 60.0


def default_worker_env(tool: str, version: str) -> Path:
    """Where the worker environment for `tool` at `version` lives unless configured."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "streamrl" / "worker-envs" / f"{tool}-{version}"


def interpreter(location: Path) -> Path:
    """The worker environment's Python."""
    return location / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")


WORKER_ENV_TOOLS = {
    "verifiers": ("0.3.1", ["verifiers=={version}"]),
    "openenv": ("0.3.0", ["openenv-core=={version}", "uvicorn"]),
}
"""Each ecosystem's worker environment: its default version and what it installs at a version."""


def default_interpreter(tool: str) -> Path:
    """The Python of `tool`'s worker environment at its default version and location."""
    return interpreter(default_worker_env(tool, WORKER_ENV_TOOLS[tool][0]))


def worker_env_command(
    version: str, location: Path | None, package: str, tool: str = "verifiers"
) -> str:
    """The command that creates the worker environment (for error messages)."""
    where = f" --path {location}" if location is not None else ""
    return f"streamrl worker-env {tool} --version {version}{where} --package {package}"


def probe_verifiers_env(location: Path, env_id: str) -> dict[str, object] | str:
    """What the worker environment at `location` holds (verifiers' version, whether `env_id`'s
    module is importable), or why it could not be asked."""
    python = interpreter(location)
    if not python.is_file():
        return f"there is no worker environment at {location}"
    try:
        done = subprocess.run(
            [str(python), "-I", "-c", _PROBE, env_id],
            capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False,
        )  # fmt: skip
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as error:
        return f"its Python {python} could not be asked what it holds ({error})"
    return found if isinstance(found, dict) else f"its Python {python} answered {found!r:.80}"


def create_worker_env(
    location: Path, version: str, packages: list[str], tool: str = "verifiers"
) -> Path:
    """Create (or update) `tool`'s worker environment at `location`: a venv with the tool at
    `version` (`WORKER_ENV_TOOLS`) and `packages` (pip requirement specifiers or paths).
    Returns its Python."""
    if not interpreter(location).is_file():
        venv.EnvBuilder(with_pip=True, clear=False).create(location)
    python = interpreter(location)
    requirements = [r.format(version=version) for r in WORKER_ENV_TOOLS[tool][1]]
    subprocess.run([str(python), "-m", "pip", "install", *requirements, *packages], check=True)
    return python
