"""Before a run's processes start on this machine: what its environments from the ecosystems
need is installed — reasoning-gym for `data.path: reasoning_gym:...`, the verifiers worker
environment with the environment's package for `generator.env.verifiers`, the OpenEnv
interpreter with the environment's package for a server the generator starts
(`generator.env.openenv`). Each missing piece is refused with the command that installs it,
before anything is written or started; generators check again where they start (another
machine of a pool).
"""

from __future__ import annotations

from streamrl.config.base import ConfigError
from streamrl.data.config import DataConfig
from streamrl.data.rows import DatasetError
from streamrl.envs.config import EnvConfig
from streamrl.envs.registry import EnvResolutionError

__all__ = ["check_prerequisites"]


def check_prerequisites(data: DataConfig, env: EnvConfig) -> None:
    """Raise `ConfigError` naming each missing prerequisite and its install command."""
    problems = []
    if data.procedural:
        from streamrl.data.reasoning_gym import import_reasoning_gym

        try:
            import_reasoning_gym()
        except DatasetError as error:
            problems.extend(error.problems)
    if env.verifiers is not None:
        from streamrl.envs.verifiers_env import check_verifiers_env

        try:
            check_verifiers_env(env.verifiers)
        except EnvResolutionError as error:
            problems.append(str(error))
    if env.openenv is not None:
        from streamrl.envs.openenv_server import check_openenv

        try:
            check_openenv(env.openenv)
        except EnvResolutionError as error:
            problems.append(str(error))
    if problems:
        raise ConfigError(problems, source="environments")
