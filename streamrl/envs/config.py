"""The `generator.env` section: which environment drives a rollout's turns, its turn and token
budgets, and the limits of its worker processes (`streamrl.envs.runner`).

Light on purpose: pydantic only, so the configuration loads without torch or vLLM.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from streamrl.config.base import MAX_SEQUENCE_TOKENS, MAX_WAIT_S, Section
from streamrl.envs.openenv_config import OpenEnvConfig
from streamrl.envs.registry import check_agent_name, check_env_name
from streamrl.envs.verifiers_config import VerifiersConfig

__all__ = ["EnvConfig"]


class EnvConfig(Section):
    """The environment a generator's episodes run in: single-turn (the default: score the
    one response with `generator.reward`), or multi-turn with tools (`streamrl.envs`)."""

    fn: str = Field(
        "single_turn",
        description="A registered environment (single_turn, calculator, python, guess) or a "
        "user's Environment subclass by import path 'package.module:ClassName'.",
    )
    agent: str | None = Field(
        None,
        description="A user's agent function by import path 'package.module:function' "
        "(`async def agent(client, task)`, streamrl.envs.agent): its episodes drive the engine "
        "through an OpenAI-compatible endpoint, and every token sampled for it is trained on. "
        "Its limits are this section's (max_turns counts its requests; episode_timeout_s bounds "
        "its whole run). null: episodes run in the environment `fn`.",
    )
    openenv: OpenEnvConfig | None = Field(
        None,
        description="Run episodes against an OpenEnv environment server (streamrl.envs."
        "openenv_env): fn becomes 'openenv'. null: no OpenEnv.",
    )
    verifiers: VerifiersConfig | None = Field(
        None,
        description="A verifiers environment that runs its own rollouts (its client, turns, "
        "tools and rubric) against the generator's endpoint, as an agent does "
        "(streamrl.envs.verifiers_env); its rubric's reward is the episode's. null: none.",
    )
    tool_parser: str | None = Field(
        None,
        description="The vLLM tool parser that reads tool calls from an agent's sampled turns "
        "(hermes, llama3_json, pythonic, ...); null: from tool_format (hermes: vLLM's hermes "
        "parser; tagged: streamrl's own).",
    )
    max_turns: int = Field(
        8,
        ge=1,
        le=1024,
        description="Most model turns in one episode; an episode still running after them "
        "ends with finish reason max_turns and is scored as it stands.",
    )
    max_episode_tokens: int | None = Field(
        None,
        gt=0,
        le=MAX_SEQUENCE_TOKENS,
        description="Token budget of a whole episode: prompt, every model turn and every "
        "observation; an episode that reaches it ends with finish reason max_tokens. null: "
        "model.max_model_len.",
    )
    turn_max_tokens: int | None = Field(
        None,
        gt=0,
        le=MAX_SEQUENCE_TOKENS,
        description="Most tokens sampled in one model turn; null: generator.max_tokens.",
    )
    call_timeout_s: float = Field(
        60.0,
        gt=0.0,
        le=MAX_WAIT_S,
        description="Time limit of one reset or step call (a step runs the turn's tool calls); "
        "past it the worker is killed and the episode ends with finish reason timeout. "
        "Scoring an episode is limited by generator.reward.timeout_s.",
    )
    episode_timeout_s: float = Field(
        300.0,
        gt=0.0,
        le=MAX_WAIT_S,
        description="Time limit of all reset and step calls of one episode together (time "
        "spent sampling does not count); past it the episode ends with finish reason timeout.",
    )
    memory_mb: int = Field(
        4096,
        ge=256,
        le=1024**2,
        description="Address-space limit (RLIMIT_AS) of each environment worker, MiB; code a "
        "tool runs in a subprocess stays under it too. An allocation beyond it fails the call.",
    )
    workers: int = Field(
        2, ge=1, le=1024, description="Processes running environment calls in parallel."
    )
    nice: int = Field(
        10,
        ge=0,
        le=19,
        description="How many steps below the generator's CPU priority its environment workers "
        "and the programs they start run (Unix nice; 0: the same). Where they share cores with "
        "sampling (a CPU generator) sampling gets them first; code tests' time limits count "
        "CPU time, so a test waiting for a core does not time out.",
    )
    startup_timeout_s: float = Field(
        120.0,
        gt=0.0,
        le=MAX_WAIT_S,
        description="Time for environment workers to start and import the environment and "
        "the reward; past it a starting generator fails naming the environment.",
    )
    observation_max_chars: int = Field(
        4000,
        ge=16,
        le=10**8,
        description="Most characters of one step's whole observation (every tool result and "
        "message answering one model turn, together); they share it, the short ones whole and "
        "the long ones cut evenly, saying so.",
    )
    observation_max_tokens: int | None = Field(
        2048,
        ge=16,
        le=MAX_SEQUENCE_TOKENS,
        description="Most tokens of one step's observation as the chat template renders it "
        "(with the template's own tokens); the generator cuts its messages' contents to fit, "
        "and ends the episode with finish reason max_tokens when even empty messages would not. "
        "null: no limit but max_episode_tokens.",
    )
    tool_format: Literal["auto", "hermes", "tagged"] = Field(
        "auto",
        description='How the model writes tool calls. hermes: <tool_call>{"name": ..., '
        '"arguments": {...}}</tool_call>, with the tools given to the chat template (Qwen, '
        "Hermes); tagged: <tool>name(arg=value)</tool>, described in the system prompt, for "
        "chat templates that know no tools (SmolLM2); auto: hermes when the tokenizer's chat "
        "template mentions tools, else tagged.",
    )

    @field_validator("fn")
    @classmethod
    def _fn_is_name_or_import_path(cls, value: str) -> str:
        check_env_name(value)  # imports nothing of the user's; a ValueError naming the fix
        return value

    @field_validator("agent")
    @classmethod
    def _agent_is_an_import_path(cls, value: str | None) -> str | None:
        if value is not None:
            check_agent_name(value)
        return value

    @property
    def multi_turn(self) -> bool:
        """Whether episodes may go on after the first turn (an agent's, or any environment's
        but single_turn)."""
        return self.fn != "single_turn" or self.episode_agent is not None

    @property
    def episode_agent(self) -> str | None:
        """The code that drives episodes through the endpoint, as a user reads it: the agent
        or the verifiers environment; None when an environment (`fn`) drives them."""
        if self.verifiers is not None:
            return f"verifiers environment {self.verifiers.env_id!r} (generator.env.verifiers)"
        return None if self.agent is None else f"agent {self.agent!r} (generator.env.agent)"

    @model_validator(mode="after")
    def _an_agent_or_an_environment(self) -> EnvConfig:
        if self.agent is not None and self.fn != "single_turn":
            raise ValueError(
                f"generator.env.agent ({self.agent!r}) and generator.env.fn ({self.fn!r}) both "
                "drive episodes; set one of them (the agent's tools are its own)"
            )
        if self.verifiers is not None and (self.agent is not None or self.fn != "single_turn"):
            other = "agent" if self.agent is not None else "fn"
            raise ValueError(
                f"generator.env.verifiers ({self.verifiers.env_id!r}) and generator.env.{other} "
                "both drive episodes; set one of them (the verifiers environment's tools and "
                "turns are its own)"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _openenv_is_its_environment(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("openenv") is not None:
            fn = data.get("fn", "single_turn")
            if fn not in ("single_turn", "openenv"):
                raise ValueError(
                    f"generator.env.openenv runs episodes on an OpenEnv server, and "
                    f"generator.env.fn ({fn!r}) names another environment; set one of them"
                )
            data = {**data, "fn": "openenv"}
        elif isinstance(data, dict) and data.get("fn") == "openenv":
            raise ValueError(
                "generator.env.fn 'openenv' needs the generator.env.openenv section (app and "
                "python, or url): set it, which selects the environment by itself"
            )
        return data

    @model_validator(mode="after")
    def _a_call_fits_in_its_episode(self) -> EnvConfig:
        if self.call_timeout_s > self.episode_timeout_s:
            raise ValueError(
                f"generator.env.call_timeout_s ({self.call_timeout_s:g}) must be ≤ "
                f"episode_timeout_s ({self.episode_timeout_s:g}): one call cannot take longer "
                "than its whole episode"
            )
        return self

    @model_validator(mode="after")
    def _a_turn_fits_in_its_episode(self) -> EnvConfig:
        episode = self.max_episode_tokens
        if self.turn_max_tokens is not None and episode and self.turn_max_tokens > episode:
            raise ValueError(
                f"generator.env.turn_max_tokens ({self.turn_max_tokens}) must be ≤ "
                f"max_episode_tokens ({self.max_episode_tokens}): a turn is part of its episode"
            )
        return self
