"""The `scorers` section: the models that score — a teacher (on-policy distillation), a reward
model or an LLM judge — each an OpenAI-compatible endpoint, by name.

    scorers:
      teacher:                       # served by the run: a vLLM server, placed and supervised
        model: ./models/teacher      #   like a generator (streamrl.scorers.serve)
        cpu_cores: 1
      judge:                         # external: an endpoint someone else runs
        url: https://judge.example/v1
        model: judge-7b              #   its served model name
        key_env: JUDGE_API_KEY   #   the key is read from this variable, never stored

Consumers name a scorer: `generator.teacher: teacher`. The client side (`timeout_s`, `retries`,
`max_concurrency`, `unavailable_s`) is `streamrl.scorers.client`'s.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from streamrl.config.base import MAX_SEQUENCE_TOKENS, MAX_WAIT_S, CoreSetting, Section

__all__ = ["SCORER_NAME", "ScorerConfig", "check_scorer_name", "scorer_process_name"]

SCORER_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def scorer_process_name(name: str) -> str:
    """Served scorer `name` as a process of the run: its placement, its supervision unit, its
    log file (logs/<this>.log) and its endpoint record (storage.control.endpoints)."""
    return f"scorer-{name}"


def check_scorer_name(name: str) -> str:
    if not SCORER_NAME.match(name):
        raise ValueError(
            f"scorer name {name!r} must be lower-case letters, digits and _, starting with a "
            "letter, at most 32 characters (it names the scorer's process and log file)"
        )
    return name


class ScorerConfig(Section):
    """One model that scores: served by the run (`url` null: vLLM's OpenAI-compatible server
    on this scorer's own cores / GPUs, restarted when it dies, stopped with the run) or an
    external endpoint (`url`)."""

    model: str = Field(
        min_length=1,
        description="Served by the run: the model directory (local or a bundled name, as "
        "model.path). External: the model name the endpoint serves.",
    )
    url: str | None = Field(
        None,
        description="An external OpenAI-compatible endpoint's base URL, e.g. "
        "http://host:8000/v1; null (default): the run serves `model` itself.",
    )
    key_env: str | None = Field(
        None,
        description="The environment variable holding the external endpoint's API key (the key "
        "itself is never written to the run's storage or logs).",
    )
    tokenizer: str | None = Field(
        None,
        description="External endpoints: the model's tokenizer directory, to check it against "
        "the policy's (a teacher must share it). Served: `model`'s own.",
    )
    task: Literal["generate", "classify"] = Field(
        "generate",
        description="generate: a language model (teacher log-probs, judge answers); classify: "
        "a sequence classifier (reward model), served through vLLM's pooling runner.",
    )
    timeout_s: float = Field(
        120.0, gt=0.0, le=MAX_WAIT_S, description="The longest one request may take."
    )
    retries: int = Field(
        2,
        ge=0,
        le=100,
        description="Retries of a request that failed on a reachable server (a timeout, a 5xx, "
        "429), with backoff; then the call fails (a counted reward failure, "
        "generator.reward.on_error).",
    )
    unavailable_s: float = Field(
        900.0,
        ge=0.0,
        le=MAX_WAIT_S,
        description="How long a call waits for an unreachable server (starting, restarting "
        "after a crash) before it fails. Calls waiting hold their groups, so flow control "
        "holds the generator back meanwhile.",
    )
    max_concurrency: int = Field(
        8, ge=1, le=4096, description="Requests one generator keeps in flight to this scorer."
    )
    # -- serving (url null) ------------------------------------------------------------------
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Served: the weights' dtype (vLLM --dtype)."
    )
    max_model_len: int | None = Field(
        None,
        gt=0,
        le=MAX_SEQUENCE_TOKENS,
        description="Served: the longest sequence (vLLM --max-model-len); null: for the "
        "teacher model.max_model_len + 1 (it scores whole sequences, then samples one token), "
        "for a judge or reward model the model's own (its rubric, the question and the "
        "response must fit; a judge is shown the response escaped, `<` as `&lt;`, which takes "
        "a few tokens more per bracket).",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Served: auto picks CUDA when available, else vLLM's CPU build."
    )
    cpu_cores: CoreSetting = Field(
        None,
        description="Served: this scorer's CPU cores, a count or a core list such as '6-7'; "
        "null: a share of the cores no other component pins, as a generator's, at background "
        "priority (see streamrl.placement).",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, le=1024, description="Served: GPUs of this scorer's engine (CUDA)."
    )
    gpu_memory_utilization: float = Field(
        0.85, gt=0.0, le=1.0, description="Served: the share of its GPUs' memory vLLM may take."
    )
    cpu_kv_cache_gib: int = Field(
        1, ge=1, le=1 << 20, description="Served: KV cache on CPU (VLLM_CPU_KVCACHE_SPACE), GiB."
    )
    max_num_seqs: int = Field(
        64, ge=1, le=1 << 16, description="Served: sequences vLLM batches at once."
    )
    vllm_args: list[str] = Field(
        default_factory=list,
        description="Served: further `vllm serve` arguments, e.g. ['--enable-prefix-caching'].",
    )
    startup_timeout_s: float = Field(
        900.0,
        gt=0.0,
        le=MAX_WAIT_S,
        description="Served: how long the server may take to answer its health check.",
    )

    @property
    def served(self) -> bool:
        """Whether the run serves this scorer (no `url`)."""
        return self.url is None

    @field_validator("key_env")
    @classmethod
    def _an_environment_variable_name(cls, value: str | None) -> str | None:
        if value is not None and not _ENV_NAME.match(value):
            raise ValueError(
                f"key_env must name an environment variable (letters, digits, _), got "
                f"{value!r}: put the key in that variable, never in the configuration"
            )
        return value

    @field_validator("url")
    @classmethod
    def _an_http_url(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^https?://[^/\s]+", value):
            raise ValueError(
                f"url must be an http(s) base URL such as http://host:8000/v1, got {value!r}"
            )
        return value.rstrip("/") if value is not None else None

    @model_validator(mode="after")
    def _serving_fields_only_when_served(self) -> ScorerConfig:
        if self.url is None and self.key_env is not None:
            raise ValueError(
                "key_env is for external endpoints (url); a scorer the run serves needs no key"
            )
        return self
