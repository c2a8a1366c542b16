"""The OpenEnv virtualenv of the OpenEnv tests, built once under the repository's
`.cache/openenv-venv` from PyPI alone, as `streamrl worker-env openenv --package textarena`
does (`openenv-core`, `uvicorn`, `textarena`: a few minutes).

The environment they serve, `guess_env` (TextArena's GuessTheNumber-v0 written as an OpenEnv
environment package), lives in `tests/openenv_envs`; a `.pth` file puts that directory on the
virtualenv's path, as an environment package installed there would be.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from streamrl.envs.worker_envs import WORKER_ENV_TOOLS, create_worker_env

ROOT = Path(__file__).resolve().parents[3]
VENV = ROOT / ".cache" / "openenv-venv"
ENVS = ROOT / "tests" / "openenv_envs"
OPENENV_VERSION = WORKER_ENV_TOOLS["openenv"][0]
GAMES = ["textarena==0.7.4"]
READY = VENV / f".ready-openenv-core-{OPENENV_VERSION}-{GAMES[0].replace('==', '-')}"


@pytest.fixture(scope="session")
def openenv_python() -> str:
    """The OpenEnv virtualenv's interpreter, with `tests/openenv_envs` on its path."""
    python = VENV / "bin" / "python"
    if not READY.exists():
        create_worker_env(VENV, OPENENV_VERSION, GAMES, tool="openenv")
        READY.touch()
    where = [str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
    purelib = subprocess.run(where, capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "streamrl_test_openenv_envs.pth").write_text(f"{ENVS}\n")
    return str(python)
