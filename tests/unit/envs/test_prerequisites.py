"""What a run's environments from the ecosystems need is checked before anything starts: a
missing verifiers worker environment or OpenEnv interpreter is refused, naming the command that
installs it, and nothing is needed when no ecosystem is used."""

from __future__ import annotations

import pytest

from streamrl.config.base import ConfigError
from streamrl.data.config import DataConfig
from streamrl.envs.config import EnvConfig
from streamrl.envs.prerequisites import check_prerequisites


def test_a_run_without_ecosystems_needs_nothing():
    check_prerequisites(DataConfig(), EnvConfig())


def test_reasoning_gym_tasks_need_reasoning_gym_which_is_installed_here():
    check_prerequisites(DataConfig(path="reasoning_gym:leg_counting", val_path=None), EnvConfig())


def test_a_missing_verifiers_worker_environment_is_refused_naming_the_command(tmp_path):
    env = EnvConfig.model_validate(
        {"verifiers": {"env_id": "vf-math", "worker_env": str(tmp_path / "nowhere")}}
    )
    with pytest.raises(ConfigError, match="streamrl worker-env verifiers") as refused:
        check_prerequisites(DataConfig(), env)
    assert str(tmp_path / "nowhere") in str(refused.value)


def test_a_missing_openenv_interpreter_is_refused_naming_the_install(tmp_path):
    env = EnvConfig.model_validate(
        {"openenv": {"app": "guess_env.server.app:app", "python": str(tmp_path / "python")}}
    )
    with pytest.raises(ConfigError, match=r"streamrl worker-env openenv .*--path"):
        check_prerequisites(DataConfig(), env)
    default = EnvConfig.model_validate({"openenv": {"app": "guess_env.server.app:app"}})
    assert default.openenv is not None
    assert "worker-envs/openenv-0.3.0" in default.openenv.interpreter
