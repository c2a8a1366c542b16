"""Environments by name: the bundled ones, or a user's class by import path.

`generator.env.fn` is a registered name (`ENVIRONMENTS`: single_turn, calculator, python,
guess, code_feedback) or `package.module:ClassName`, a subclass of `streamrl.envs.Environment`
at module level in a module on the Python path (environment workers are spawned and import it
there).

As with rewards (`streamrl.rewards.registry`), importing a user's module runs user code, so
only environment workers call `resolve_env`; generators call `check_env_name`, which imports
nothing of the user's.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from streamrl.envs.base import Environment
from streamrl.isolation.user_code import import_object, refuse_unknown_name, split_import_path

__all__ = [
    "ENVIRONMENTS",
    "EnvLoadError",
    "EnvResolutionError",
    "check_agent_name",
    "check_env_name",
    "registered_envs",
    "resolve_env",
]

ENVIRONMENTS: Mapping[str, str] = MappingProxyType(
    {
        "single_turn": "streamrl.envs.base:SingleTurnEnv",
        "calculator": "streamrl.envs.calculator:CalculatorEnv",
        "python": "streamrl.envs.python_env:PythonEnv",
        "guess": "streamrl.envs.guess:GuessEnv",
        "code_feedback": "streamrl.envs.code_feedback:CodeFeedbackEnv",
        "openenv": "streamrl.envs.openenv_env:OpenEnvEnvironment",
    }
)
"""Registered names → import paths (imported only when resolved)."""


class EnvResolutionError(ValueError):
    """`generator.env.fn` names no usable environment; the message says what to change. Raised
    as such (not as `EnvLoadError`), it fails the same way every time: the name, the module or
    the class is not there or is no environment."""


class EnvLoadError(EnvResolutionError):
    """The environment workers could not start, which may not happen again: the import or the
    environment's construction raised or was still running at `startup_timeout_s`, or a worker
    died starting."""


def registered_envs() -> list[str]:
    """The registered environment names, sorted."""
    return sorted(ENVIRONMENTS)


def check_env_name(name_or_path: str) -> None:
    """Fail fast on what can be told without running user code: an unknown registered name,
    or an import path that is not `package.module:ClassName` (a dotted name without the colon
    included).

    Raises:
        EnvResolutionError: the message says what to change.
    """
    _import_path(name_or_path)


def check_agent_name(path: str) -> None:
    """Fail fast, importing nothing, on an agent path that is not 'package.module:function';
    a dotted name without its colon is refused with the colon put in place."""
    if split_import_path(path) is not None:
        return
    module, _, function = path.rpartition(".")
    if ":" not in path and split_import_path(f"{module}:{function}", dotted_attribute=False):
        raise EnvResolutionError(
            f"agent import path {path!r} has no colon, which separates the module from the "
            f"function: write it as '{module}:{function}' (generator.env.agent)"
        )
    raise EnvResolutionError(
        f"agent import path {path!r} must look like 'package.module:function' (generator.env.agent)"
    )


def resolve_env(name_or_path: str) -> type[Environment]:
    """The environment class `name_or_path` names. Imports the user's module: call it in an
    environment worker only.

    Raises:
        EnvResolutionError: unknown name (with the registered names and the closest one), a
            module that cannot be imported, a missing attribute, or something that is not an
            `Environment` subclass.
    """
    path = _import_path(name_or_path)
    target = import_object(path, "environment", EnvResolutionError, EnvLoadError)
    if not (isinstance(target, type) and issubclass(target, Environment)):
        raise EnvResolutionError(
            f"environment {name_or_path!r} is {type(target).__name__} {target!r:.60}, not a "
            "subclass of streamrl.envs.Environment; point generator.env.fn at such a class"
        )
    return target


def _import_path(name_or_path: str) -> str:
    if ":" in name_or_path:
        if split_import_path(name_or_path) is None:
            raise EnvResolutionError(
                f"environment import path {name_or_path!r} must look like "
                "'package.module:ClassName'"
            )
        return name_or_path
    if name_or_path in ENVIRONMENTS:
        return ENVIRONMENTS[name_or_path]
    refuse_unknown_name(
        name_or_path,
        what="environment",
        example="calculator",
        registered=registered_envs(),
        user_form="a user's Environment subclass as 'package.module:ClassName'",
        error=EnvResolutionError,
    )
