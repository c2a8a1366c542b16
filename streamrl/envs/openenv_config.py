"""The `generator.env.openenv` section: which OpenEnv environment server episodes run against,
how it is started, and how its actions, observations and rewards map onto an episode
(`streamrl.envs.openenv_env`, `streamrl.envs.openenv_server`).

Light on purpose: pydantic only, so the configuration loads without the openenv packages (which
live in a virtualenv of their own: they pull in gradio and a pandas the trainer does not use).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from streamrl.config.base import MAX_WAIT_S, Section
from streamrl.envs.worker_envs import default_interpreter

__all__ = ["OpenEnvConfig"]


class OpenEnvConfig(Section):
    """An OpenEnv environment server: started by the generator from `app` in the virtualenv of
    `python`, on 127.0.0.1 with a free port, or reached at `url`. Exactly one of `app` / `url`."""

    app: str | None = Field(
        None,
        description="The OpenEnv server's ASGI app as 'package.module:app' in the virtualenv of "
        "`python`, e.g. 'textarena_env.server.app:app'; the generator runs it with uvicorn on "
        "127.0.0.1 and stops it with the generator.",
    )
    python: str | None = Field(
        None,
        description="The interpreter of the virtualenv the OpenEnv packages and the "
        "environment's are installed in; null: the OpenEnv worker environment's "
        "(<cache>/streamrl/worker-envs/openenv-<version>, `streamrl worker-env openenv`).",
    )
    url: str | None = Field(
        None,
        description="Base URL of an OpenEnv server already running (http://host:port); "
        "instead of `app`.",
    )
    server_env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables of a started server, e.g. "
        "{TEXTARENA_ENV_ID: GuessTheNumber-v0}; nothing else of the generator's environment "
        "reaches it but PATH, HOME and the locale.",
    )
    reset: dict[str, object] = Field(
        default_factory=dict,
        description="Fields sent with every reset (e.g. {seed: 0}); a dataset row's "
        "`openenv_reset` object, when it has one, is merged over them.",
    )
    action_field: str = Field(
        "message",
        min_length=1,
        description="The action field the model's turn is sent in (text environments: message).",
    )
    max_action_chars: int = Field(
        65536,
        ge=1,
        le=10**7,
        description="Longest model turn sent as an action, in characters; a longer turn is cut "
        "to it (the policy's text is never trusted to be small).",
    )
    reward_range: tuple[float, float] = Field(
        (0.0, 1.0),
        description="The range [low, high] of an episode's summed server rewards; the episode's "
        "score is the sum mapped linearly onto [0, 1]. A sum outside it is the environment's "
        "error (env_error).",
    )
    startup_timeout_s: float = Field(
        120.0,
        gt=0.0,
        le=MAX_WAIT_S,
        description="Time for a started server to answer /health; past it the generator fails "
        "naming the server's last output.",
    )
    max_sessions: int = Field(
        1024,
        ge=1,
        le=1_000_000,
        description="Most episodes open on the server at once (one WebSocket session each; "
        "a started server's MAX_CONCURRENT_ENVS unless server_env sets it); a reset beyond it "
        "fails as the environment's error.",
    )

    @model_validator(mode="after")
    def _an_app_or_a_url(self) -> OpenEnvConfig:
        if (self.app is None) == (self.url is None):
            raise ValueError(
                "generator.env.openenv needs exactly one of app (a server the generator starts, "
                "with python: its virtualenv's interpreter) or url (a server already running)"
            )
        if self.app is not None and ":" not in self.app:
            raise ValueError(
                f"generator.env.openenv.app ({self.app!r}) must look like 'package.module:app'"
            )
        low, high = self.reward_range
        if not low < high:
            raise ValueError(
                f"generator.env.openenv.reward_range {self.reward_range} needs low < high"
            )
        return self

    @property
    def interpreter(self) -> str:
        """The server's Python: `python`, else the default OpenEnv worker environment's."""
        return self.python or str(default_interpreter("openenv"))

    @property
    def module(self) -> str | None:
        """The module of `app` ('textarena_env.server.app'), checked installed before start."""
        return None if self.app is None else self.app.partition(":")[0]
