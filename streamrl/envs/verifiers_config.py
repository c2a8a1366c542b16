"""`generator.env.verifiers`: a verifiers environment (`verifiers.load_environment`) that runs
its own rollouts against the generator's endpoint (`streamrl.envs.verifiers_env`).

Light on purpose: pydantic only, so the configuration loads without torch or vLLM.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from streamrl.config.base import Section
from streamrl.envs.worker_envs import WORKER_ENV_TOOLS, default_worker_env

__all__ = ["DEFAULT_VERIFIERS_VERSION", "VerifiersConfig"]

DEFAULT_VERIFIERS_VERSION = WORKER_ENV_TOOLS["verifiers"][0]
"""The newest verifiers with `load_environment` (0.4.0 holds only its v1 stack)."""
_ENV_ID = re.compile(r"[A-Za-z0-9_.\-/@]{1,200}")


class VerifiersConfig(Section):
    """Which verifiers environment drives the episodes, with what arguments, in which worker
    environment, and how its rubric's reward maps to streamrl's [0, 1]."""

    env_id: str = Field(
        description="The environment's id, as `verifiers.load_environment` takes it (its "
        "installed module's name, '-' for '_': 'vf-math' imports vf_math)."
    )
    env_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the environment's load_environment (JSON values).",
    )
    version: str = Field(
        DEFAULT_VERIFIERS_VERSION,
        pattern=r"^[0-9][0-9A-Za-z.+\-]{0,40}$",
        description="The verifiers release of the worker environment (its default location "
        "is named after it).",
    )
    worker_env: str | None = Field(
        None,
        description="The worker environment's directory (a virtualenv with verifiers and the "
        "environment's package); null: <cache>/streamrl/worker-envs/verifiers-<version>. "
        "`streamrl worker-env verifiers` creates it.",
    )
    reward_range: tuple[float, float] = Field(
        (0.0, 1.0),
        description="[lowest, highest] reward the rubric gives (its weighted sum); mapped "
        "linearly onto [0, 1], the reward streamrl scales (algorithm.reward_scale). A reward "
        "outside it fails its episode (env_error), naming this setting.",
    )

    @field_validator("env_id")
    @classmethod
    def _env_id_is_a_name(cls, value: str) -> str:
        if not _ENV_ID.fullmatch(value):
            raise ValueError(
                f"generator.env.verifiers.env_id {value!r} must be an environment id such as "
                "'vf-math' (letters, digits, '_', '-', '.', '/', '@')"
            )
        return value

    @model_validator(mode="after")
    def _reward_range_is_an_interval(self) -> VerifiersConfig:
        low, high = self.reward_range
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError(
                f"generator.env.verifiers.reward_range {list(self.reward_range)} must be two "
                "finite numbers, the lowest first"
            )
        return self

    @property
    def location(self) -> Path:
        """The worker environment's directory."""
        if self.worker_env is not None:
            return Path(self.worker_env).expanduser()
        return default_worker_env("verifiers", self.version)
