"""The `generator` section: sampling, the engine, flow control and stream writing
(`streamrl.generator.loop`, `streamrl.generator.engine`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from streamrl.config.base import MAX_SEED, MAX_SEQUENCE_TOKENS, MAX_WAIT_S, CoreSetting, Section
from streamrl.envs.config import EnvConfig
from streamrl.generator.group_size import AdaptiveGroupSize, FixedGroupSize, GroupSizeRule
from streamrl.rewards.config import RewardConfig

__all__ = [
    "MAX_GROUP_SIZE",
    "AdaptiveGroupConfig",
    "GeneratorConfig",
]

MAX_GROUP_SIZE = 4096
"""The most responses one prompt's group may have (vLLM's n)."""


class AdaptiveGroupConfig(Section):
    """Adaptive group size (the framework guide's eq 27, `streamrl.generator.group_size`): each
    prompt gets G = clamp(⌊generator.group_size · ref_length / ℓ⌋, min_size, max_size)
    responses, ℓ the generator's running mean response length in sampled tokens."""

    ref_length: int = Field(
        gt=0,
        le=MAX_SEQUENCE_TOKENS,
        description="L_ref, tokens (required): the mean response length at which G = "
        "generator.group_size; shorter responses get more samples, longer ones fewer. Also ℓ "
        "before the generator finished any group (and after it restarts: ℓ is not saved).",
    )
    min_size: int = Field(
        2, ge=2, le=MAX_GROUP_SIZE, description="G_min: the fewest responses of a group."
    )
    max_size: int | None = Field(
        None,
        ge=2,
        le=MAX_GROUP_SIZE,
        description="G_max: the most responses of a group; null: 2 × generator.group_size "
        f"(at least min_size, at most {MAX_GROUP_SIZE}).",
    )
    ema: float = Field(
        0.9,
        ge=0.0,
        lt=1.0,
        description="Decay of the running mean: ℓ ← ema·ℓ + (1 − ema)·(a finished group's "
        "mean sampled length); 0 follows the last group alone.",
    )

    @model_validator(mode="before")
    @classmethod
    def _ref_length_given(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and data.get("ref_length") is None:
            raise ValueError(
                "generator.adaptive_group.ref_length (L_ref) is required to turn adaptive group "
                "size on: set it to the mean response length, in sampled tokens, at which a "
                "prompt gets generator.group_size responses, e.g. "
                "generator.adaptive_group.ref_length=512 (or set generator.adaptive_group=null)"
            )
        return data

    @model_validator(mode="after")
    def _min_size_at_most_max_size(self) -> AdaptiveGroupConfig:
        if self.max_size is not None and self.min_size > self.max_size:
            raise ValueError(
                f"generator.adaptive_group.min_size ({self.min_size}) must be ≤ "
                f"generator.adaptive_group.max_size ({self.max_size}); lower min_size or raise "
                "max_size"
            )
        return self

    def largest(self, group_size: int) -> int:
        """G_max for a generator whose `generator.group_size` is `group_size`."""
        if self.max_size is not None:
            return self.max_size
        return max(self.min_size, min(2 * group_size, MAX_GROUP_SIZE))

    def rule(self, group_size: int) -> AdaptiveGroupSize:
        """A fresh rule (ℓ = ref_length) around G_base = `group_size`."""
        return AdaptiveGroupSize(
            base=group_size,
            ref_length=self.ref_length,
            min_size=self.min_size,
            max_size=self.largest(group_size),
            ema=self.ema,
        )


class GeneratorConfig(Section):
    """vLLM generators: sampling, scoring and writing to the replay stream."""

    group_size: int = Field(
        8,
        ge=1,
        le=MAX_GROUP_SIZE,
        description="G: responses sampled per prompt (vLLM n); G_base of adaptive_group.",
    )
    adaptive_group: AdaptiveGroupConfig | None = Field(
        None,
        description="Adaptive group size (eq 27): G = clamp(⌊group_size · L_ref / ℓ⌋, G_min, "
        "G_max) per prompt, ℓ an EMA of this generator's finished groups' mean response length "
        "in sampled tokens, so groups of different sizes reach the learner. null (default): "
        "every group has group_size responses. Turn on with "
        "generator.adaptive_group.ref_length=L_REF.",
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
        32,
        ge=1,
        le=1_000_000,
        description="Groups being sampled at once (in the engine or their environment). With "
        "the groups waiting for their scores, up to twice as many are in flight: scoring "
        "holds sampling back only once that many wait.",
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
        "a count or a core list such as '4-7' (a bare number is a count). null: the cores no "
        "other component pins, shared with the learner at background priority (see "
        "streamrl.placement).",
    )
    reward: RewardConfig = Field(
        default_factory=RewardConfig, description="The reward function and its sandbox."
    )
    teacher: str | None = Field(
        None,
        description="On-policy distillation: the scorer (a name in `scorers`, task generate) "
        "whose log-probs of every sampled token the records carry (algorithm.opd trains on "
        "them). Its tokenizer must be the policy's. null (default): no teacher.",
    )
    env: EnvConfig = Field(
        default_factory=EnvConfig,
        description="The environment episodes run in: single-turn (default) or multi-turn "
        "with tools (streamrl.envs).",
    )
    identical_failed_groups_to_stop: int = Field(
        8,
        ge=1,
        le=1_000_000,
        description="When the user's agent, environment or reward failed every time it ran in "
        "this many groups in a row, all the same way (the same error, every request of an "
        "agent refused for the same reason, or no request at all), before it ever succeeded, "
        "the generator stops with that reason (exit code 4) and the run with it: a restart "
        "would fail alike. Once it succeeded, failures never stop it this way "
        "(streamrl.generator.failures).",
    )

    @property
    def largest_group_size(self) -> int:
        """The most responses one request of this generator's engine samples: a group of its
        rule (G, or G_max with adaptive_group), or `group_size`, what `Engine.submit` samples
        when asked for no `n`. The engine spaces request seeds by it."""
        if self.adaptive_group is None:
            return self.group_size
        return max(self.group_size, self.adaptive_group.largest(self.group_size))

    @property
    def smallest_group_size(self) -> int:
        """The fewest responses a group of this generator has: `group_size`, or G_min with
        adaptive_group (the rule clamps every G to at least it)."""
        return self.group_size if self.adaptive_group is None else self.adaptive_group.min_size

    def group_size_rule(self) -> GroupSizeRule:
        """A fresh rule for the size of each group (`streamrl.generator.group_size`)."""
        if self.adaptive_group is None:
            return FixedGroupSize(self.group_size)
        return self.adaptive_group.rule(self.group_size)

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
