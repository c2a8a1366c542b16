"""The `generator` section: sampling, the engine, flow control and stream writing
(`streamrl.generator.loop`, `streamrl.generator.engine`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from streamrl.config_base import MAX_SEED, MAX_SEQUENCE_TOKENS, MAX_WAIT_S, Section
from streamrl.envs.config import EnvConfig
from streamrl.placement.cores import CoreSetting
from streamrl.rewards.config import RewardConfig

__all__ = [
    "GeneratorConfig",
]


class GeneratorConfig(Section):
    """vLLM generators: sampling, scoring and writing to the replay stream."""

    group_size: int = Field(
        8, ge=1, le=4096, description="G: responses sampled per prompt (vLLM n)."
    )
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, le=MAX_SEQUENCE_TOKENS, description="Top-k sampling; 0 disables.")
    max_tokens: int = Field(
        1024,
        gt=0,
        le=MAX_SEQUENCE_TOKENS,
        description="L_max: the longest response in tokens; longer ones truncate.",
    )
    stop: list[str] = Field(default_factory=list, description="Extra stop strings.")
    seed: int = Field(
        0, ge=0, le=MAX_SEED, description="Engine seed (per generator: seed + index)."
    )
    count: int = Field(1, ge=1, le=100_000, description="Number of generators a run starts.")
    prompts_in_flight: int = Field(
        32, ge=1, le=1_000_000, description="Prompts submitted to the engine and not yet finished."
    )
    segment_groups: int = Field(
        16,
        ge=1,
        le=1_000_000,
        description="Write a stream segment after this many scored groups...",
    )
    segment_seconds: float = Field(
        30.0,
        gt=0.0,
        le=MAX_WAIT_S,
        description="...or after this many seconds, whichever comes first.",
    )
    weight_poll_s: float = Field(
        10.0, gt=0.0, le=MAX_WAIT_S, description="How often to look for newly published weights."
    )
    flow_control: Literal["staleness", "off"] = Field(
        "staleness",
        description="staleness (default): admit a new prompt only while the groups committed "
        "but not yet consumed by the learner, plus this generator's uncommitted ones, can still "
        "be trained on within learner.max_staleness (see streamrl.generator.flow_control); "
        "off: always keep prompts_in_flight prompts in the engine.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto picks CUDA when available, else vLLM's CPU build."
    )
    gpu_memory_utilization: float = Field(
        0.85, gt=0.0, le=1.0, description="Share of GPU memory vLLM may take (CUDA)."
    )
    tensor_parallel_size: int = Field(
        1, ge=1, le=1024, description="GPUs per generator engine (CUDA)."
    )
    cpu_kv_cache_gib: int = Field(
        1, ge=1, le=1 << 20, description="KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE), GiB."
    )
    cpu_engine_process: bool = Field(
        False,
        description="On vLLM's CPU build, run the engine core in a process of its own (as "
        "vLLM does on CUDA) rather than in the generator's.",
    )
    enforce_eager: bool = Field(
        False, description="Disable CUDA graphs / compilation (faster start, slower decode)."
    )
    cpu_cores: CoreSetting = Field(
        None,
        description="CPU cores of the run's generators together, split evenly between them: "
        "a count or a core list such as '4-7' (a bare number is a count). null: what the "
        "learner leaves (see streamrl.placement).",
    )
    reward: RewardConfig = Field(
        default_factory=RewardConfig, description="The reward function and its sandbox."
    )
    env: EnvConfig = Field(
        default_factory=EnvConfig,
        description="The environment episodes run in: single-turn (default) or multi-turn "
        "with tools (streamrl.envs).",
    )

    @field_validator("flow_control", mode="before")
    @classmethod
    def _yaml_off_is_off(cls, value: object) -> object:
        # YAML 1.1 reads a bare `off` as false.
        return "off" if value is False else value

    @model_validator(mode="after")
    def _sampling_the_learner_can_score(self) -> GeneratorConfig:
        # vLLM's processed log-probs renormalise over the top-k / nucleus set; the learner
        # scores the full softmax(z / T), so every importance ratio would be biased.
        if self.top_p < 1.0 or self.top_k > 0:
            raise ValueError(
                f"generator.top_p={self.top_p} / generator.top_k={self.top_k} truncate the "
                "sampling distribution, but the learner scores the full softmax(z / "
                "temperature): every importance weight would be biased. Use generator.top_p=1.0 "
                "and generator.top_k=0 (the DAPO recipe's setting) and steer exploration with "
                "generator.temperature"
            )
        return self
