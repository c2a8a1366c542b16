"""The `generator.reward` section: the verifiable reward and the limits of its worker processes
(`streamrl.rewards.scoring`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from streamrl.config.base import MAX_WAIT_S, Section
from streamrl.rewards.code.config import CodeRewardConfig
from streamrl.rewards.registry import RewardSpec, check_reward_name

__all__ = [
    "RewardConfig",
]


class RewardConfig(Section):
    """The verifiable reward function a generator scores responses with."""

    fn: str = Field(
        "math",
        description="A registered reward name (math, format, ...) or a user function by import "
        "path 'package.module:function'.",
    )
    timeout_s: float = Field(
        10.0,
        gt=0.0,
        le=MAX_WAIT_S,
        description="Per-call time limit; a call that exceeds it fails (on_error).",
    )
    workers: int = Field(2, ge=1, le=1024, description="Processes scoring responses in parallel.")
    memory_mb: int = Field(
        4096,
        ge=256,
        le=1024**2,
        description="Address-space limit (RLIMIT_AS) of each reward worker, MiB: an allocation "
        "beyond it fails and the call counts as failed (on_error). Counts virtual memory, "
        "which threads and mapped files take too.",
    )
    startup_timeout_s: float = Field(
        120.0,
        gt=0.0,
        le=MAX_WAIT_S,
        description="Time for reward workers to start and import the reward's module. Past "
        "it a starting generator fails naming the reward; workers restarted mid-run count the "
        "calls waiting for them as failed (on_error) and are tried again next batch.",
    )
    on_error: Literal["drop_group", "score_zero"] = Field(
        "drop_group",
        description="A group with a reward call that raised or timed out: drop_group leaves it "
        "out of the stream, score_zero trains on it with 0 for the failed responses (as wrong). "
        "Both count the failures in the stream's commit records (shown by `streamrl status`).",
    )

    code: CodeRewardConfig = Field(
        default_factory=CodeRewardConfig,
        description="The code reward's settings (fn: code): tests, layout, limits.",
    )

    @field_validator("fn")
    @classmethod
    def _fn_is_name_or_import_path(cls, value: str) -> str:
        check_reward_name(value)  # imports nothing of the user's; a ValueError naming the fix
        return value

    def spec(self) -> RewardSpec:
        """What a reward worker loads (`streamrl.rewards.registry.resolve_reward`)."""
        return RewardSpec(self.fn, self.code, self.timeout_s)
