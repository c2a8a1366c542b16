"""Typed run configuration: one pydantic model per component, composed into `RunConfig`.

A configuration is built in layers, later layers winning key by key (`deep_merge`):

1. the field defaults below (a DAPO run of the bundled SmolLM2 model on CPU);
2. presets, by name (`streamrl/presets/<name>.yaml`) or path, in the order given; a preset may
   itself `extends:` others;
3. a user YAML file (which may also say `extends: [dapo, tiny-cpu]`);
4. dotted command-line overrides: `learner.lr=1e-6 algorithm.name=grpo`.

Validation runs once on the merged result. Every problem is reported together, each naming the
field (`learner.lr`) and what to do about it; see `ConfigError`.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from storage.credentials import CREDENTIAL_NAME, credential_paths
from storage.stream_sweep import min_sweep_grace_s
from streamrl._dicts import deep_merge
from streamrl.algorithms.config import (
    ALGORITHM_CLASSES,
    ALGORITHM_NAMES,
    AlgorithmConfig,
    DAPOConfig,
)
from streamrl.placement import parse_cores

__all__ = [
    "CREDENTIAL_OVERRIDE",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "EvalConfig",
    "GeneratorConfig",
    "HealthConfig",
    "LearnerConfig",
    "LoggingConfig",
    "ModelConfig",
    "Override",
    "PlacementConfig",
    "RewardConfig",
    "RunConfig",
    "StorageConfig",
    "available_presets",
    "load_config",
    "parse_overrides",
    "validate_config",
]


MIN_SWEEP_GRACE_S = min_sweep_grace_s()

MAX_WAIT_S = 30 * 24 * 3600.0
"""The longest duration any `*_s` field takes (30 days): far below `threading.TIMEOUT_MAX`,
the longest timeout a lock, event or queue wait accepts."""
MAX_SEQUENCE_TOKENS = 2**20
"""The longest prompt, response or sequence in tokens any length field takes."""
MAX_SEED = 2**31 - 1
"""The largest seed: every RNG streamrl seeds (Python, NumPy, torch, vLLM) takes it."""
MAX_STEPS = 10**9
"""The largest step, version or interval count."""
MAX_CORES = 65536
"""CPU core counts and core numbers are below this."""


class _Component(BaseModel):
    """A configuration section: unknown fields refused, every float finite (no inf or nan,
    whatever its bounds), and no credentials anywhere in it (`_no_credentials`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_credentials(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and (found := credential_paths(data)):
            raise ValueError(_credentials_problem(found))
        return data


def _credentials_problem(paths: Sequence[str]) -> str:
    """What to do about credentials found in a configuration at `paths` (never their values)."""
    return (
        f"credentials do not belong in the configuration ({', '.join(paths)}): it is stored in "
        "run.json and control/config.json and shown in wandb and in flow-run parameters. "
        "Remove them and give them to the processes as environment variables (AWS_ACCESS_KEY_ID "
        "/ AWS_SECRET_ACCESS_KEY or an AWS profile for S3, WANDB_API_KEY, HF_TOKEN) or, on "
        "work pools, through the pool's Kubernetes secret (deploy/README.md); the S3 endpoint "
        "is storage.endpoint_url"
    )


def _core_setting(value: Any) -> Any:
    """A count (4, "4") or a core list ("0-3,8", [0, 1, 2, 3, 8]) → int or sorted list."""
    if isinstance(value, str):
        value = int(value) if value.strip().isdigit() else parse_cores(value)
    if isinstance(value, bool):
        raise ValueError("give a core count (4) or a core list ('0-3,8'), not true/false")
    if isinstance(value, int) and not 1 <= value < MAX_CORES:
        raise ValueError(
            f"a core count must be ≥ 1 and < {MAX_CORES}, got {value}; null picks cores "
            "automatically"
        )
    if isinstance(value, list):
        if not value or any(not isinstance(c, int) or not 0 <= c < MAX_CORES for c in value):
            raise ValueError(f"a core list holds core numbers ≥ 0 and < {MAX_CORES}, got {value}")
        value = sorted(set(value))
    return value


# CPU cores of a component: null (automatic), a count, or a core list ("0-3,8").
CoreSetting = Annotated[int | list[int] | None, BeforeValidator(_core_setting)]

# An Adam moment decay: 1 would never forget (and divide by zero in the bias correction).
AdamBeta = Annotated[float, Field(ge=0.0, lt=1.0)]


# --------------------------------------------------------------------------------------------
# Components
# --------------------------------------------------------------------------------------------


class CriticConfig(_Component):
    """The value model (VAPO): the policy's backbone with a scalar head."""

    init_from: str = Field(
        "policy",
        min_length=1,
        description="'policy' to start from the policy's weights, or a path to a reward model.",
    )


class ModelConfig(_Component):
    """The policy model, shared by generators and the learner."""

    path: str = Field(
        "smollm2-135m-instruct",
        min_length=1,
        description="Hugging Face model directory (local or fsspec URL), or a bundled model "
        "prepared by `streamrl models prepare`: tiny-qwen2, smollm2-135m-instruct.",
    )
    tokenizer: str | None = Field(
        None, description="Tokenizer directory when it differs from `path`."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16",
        description="Parameter dtype for generation and the learner's compute. float32 makes "
        "generator and learner log-probs agree exactly on CPU.",
    )
    max_model_len: int = Field(
        2048,
        gt=0,
        le=MAX_SEQUENCE_TOKENS,
        description="Longest prompt + response in tokens (vLLM max_model_len).",
    )
    trust_remote_code: bool = Field(
        False, description="Allow model code from the model directory (transformers/vLLM)."
    )
    critic: CriticConfig | None = Field(
        None, description="Value model; required by vapo, unused (and rejected) otherwise."
    )


class DataConfig(_Component):
    """The prompt dataset."""

    path: str = Field(
        "builtin:arithmetic",
        min_length=1,
        description="JSONL or Parquet file (local or fsspec URL, e.g. s3://...), or a bundled "
        "dataset: builtin:arithmetic, builtin:math.",
    )
    format: Literal["auto", "jsonl", "parquet"] = Field(
        "auto", description="File format; auto infers it from the extension."
    )
    prompt_field: str = Field(
        "prompt",
        min_length=1,
        description="Field with the prompt: a string or a list of chat messages (verl layout). "
        "Dotted paths reach into nested fields.",
    )
    answer_field: str = Field(
        "reward_model.ground_truth",
        min_length=1,
        description="Field with the ground-truth answer (dotted path; verl/DAPO-Math-17k layout "
        "by default).",
    )
    system_prompt: str | None = Field(
        None, description="System message prepended to every prompt, if any."
    )
    apply_chat_template: bool = Field(
        True, description="Format prompts with the tokenizer's chat template."
    )
    max_prompt_len: int = Field(
        512,
        gt=0,
        le=MAX_SEQUENCE_TOKENS,
        description="Prompts longer than this many tokens are dropped and counted.",
    )
    shuffle_seed: int = Field(
        0,
        ge=0,
        le=MAX_SEED,
        description="Seed of the per-epoch shuffle (deterministic across restarts).",
    )
    val_path: str | None = Field(
        None, description="Held-out validation set (same layout), for evaluation."
    )


class RewardConfig(_Component):
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

    @field_validator("fn")
    @classmethod
    def _fn_is_name_or_import_path(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?", value):
            raise ValueError(
                f"{value!r} is neither a reward name (e.g. 'math') nor an import path "
                "'package.module:function'"
            )
        return value


class GeneratorConfig(_Component):
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


class LearnerConfig(_Component):
    """The FSDP2 learner: batching, optimiser, staleness, publishing and checkpoints."""

    total_steps: int = Field(
        100, ge=1, le=MAX_STEPS, description="Step budget; the run ends after it."
    )
    batch_groups: int = Field(
        16, ge=1, le=1_000_000, description="B: accepted groups (prompts) per training batch."
    )
    mini_batch_groups: int = Field(
        16,
        ge=1,
        le=1_000_000,
        description="Groups per optimiser update; batch_groups / mini_batch_groups updates "
        "per batch.",
    )
    micro_batch_tokens: int = Field(
        8192,
        gt=0,
        le=2**30,
        description="Token budget of one forward/backward micro-batch per rank.",
    )
    max_staleness: int = Field(
        4,
        ge=0,
        le=MAX_STEPS,
        description="Drop groups sampled more than this many weight versions ago; 0 is "
        "synchronous on-policy RL.",
    )
    lr: float = Field(1e-6, gt=0.0, description="Actor peak learning rate (AdamW).")
    critic_lr: float = Field(2e-6, gt=0.0, description="Critic peak learning rate (vapo).")
    weight_decay: float = Field(0.1, ge=0.0, description="AdamW decoupled weight decay.")
    betas: tuple[AdamBeta, AdamBeta] = Field(
        (0.9, 0.999), description="AdamW β1, β2, each in [0, 1)."
    )
    eps: float = Field(1e-8, gt=0.0, description="AdamW ε.")
    warmup_steps: int = Field(
        10, ge=0, le=MAX_STEPS, description="Linear learning-rate warm-up steps."
    )
    schedule: Literal["constant", "cosine"] = Field(
        "constant", description="Learning-rate schedule after warm-up."
    )
    min_lr_ratio: float = Field(
        0.0, ge=0.0, le=1.0, description="Cosine floor as a fraction of the peak lr."
    )
    grad_clip: float | None = Field(
        1.0, gt=0.0, description="Clip the global gradient norm to this; null disables."
    )
    publish_every: int = Field(
        1,
        ge=1,
        le=MAX_STEPS,
        description="Publish weights every K steps (each publication is a version).",
    )
    checkpoint_every: int = Field(50, ge=1, le=MAX_STEPS, description="Checkpoint every M steps.")
    keep_checkpoints: int = Field(2, ge=1, le=10_000, description="Committed checkpoints retained.")
    stream_timeout_s: float = Field(
        600.0,
        gt=0.0,
        le=MAX_WAIT_S,
        description="Fail when the stream yields no data for this long.",
    )
    lease_ttl_s: float = Field(
        60.0,
        ge=1.0,
        le=3600.0,
        description="The learner's lease on the run (one learner per run) lasts this long "
        "without renewal: a new learner may take the run over once it lapsed (or at once with "
        "--take-over), and the old one then writes nothing more.",
    )
    max_skipped_updates: int = Field(
        5,
        ge=1,
        le=1_000_000,
        description="Fail the learner after this many optimiser updates in a row were skipped "
        "for a non-finite gradient norm (each skip is counted and logged).",
    )
    nproc_per_node: int = Field(1, ge=1, le=1024, description="Learner processes (ranks) per node.")
    nnodes: int = Field(
        1,
        ge=1,
        le=100_000,
        description="Learner nodes (machines, pods) of nproc_per_node ranks each. More than one "
        "needs placement.mode=pools: each node is a run of the learner deployment, joined by "
        "torchrun's rendezvous at an address node 0 publishes in the run's storage.",
    )
    rendezvous_timeout_s: float = Field(
        900.0,
        gt=0.0,
        le=MAX_WAIT_S,
        description="How long a learner node waits for node 0's address (its pod may still be "
        "scheduled) before its attempt fails.",
    )
    gpus: int | list[Annotated[int, Field(ge=0)]] | None = Field(
        None,
        description="The learner's GPUs, one per rank: their number (= nproc_per_node) or "
        "their positions among this machine's visible GPUs ([4, 5, 6, 7]). null: the first "
        "nproc_per_node; generators and the evaluator take the next ones, "
        "generator.tensor_parallel_size each.",
    )
    cpu_cores: CoreSetting = Field(
        None,
        description="CPU cores of the learner (all its ranks): a count or a core list such as "
        "'0-3,8' (a bare number is a count). null: half the cores this machine lets the run "
        "use when generators share it, else all.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto picks CUDA when available."
    )
    mixed_precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="FSDP2 compute dtype; auto is bf16 on CUDA (fp32 reduce), fp32 on CPU."
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute decoder-layer activations in the backward pass."
    )
    shared_prompt: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Compute each group's prompt once for all its responses (one row: the "
        "prompt, then each response attending to the prompt and itself). auto: on where the "
        "model's attention takes such a mask (SDPA); off: a row per response.",
    )
    logprob_chunk_tokens: int = Field(
        1024,
        gt=0,
        le=MAX_SEQUENCE_TOKENS,
        description="Tokens per chunk for log-prob/entropy over the vocabulary.",
    )
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed for parameter init and data order.")

    @model_validator(mode="after")
    def _mini_batches_divide_the_batch(self) -> LearnerConfig:
        if self.batch_groups % self.mini_batch_groups:
            raise ValueError(
                f"batch_groups ({self.batch_groups}) must be a multiple of mini_batch_groups "
                f"({self.mini_batch_groups}); e.g. set learner.mini_batch_groups="
                f"{self.batch_groups}"
            )
        return self

    @model_validator(mode="after")
    def _one_gpu_per_rank(self) -> LearnerConfig:
        if self.gpus is None:
            return self
        listed = len(self.gpus) if isinstance(self.gpus, list) else self.gpus
        if listed != self.nproc_per_node:
            raise ValueError(
                f"learner.gpus gives {listed} GPU(s) but learner.nproc_per_node is "
                f"{self.nproc_per_node}: one GPU per rank; set both to the same number"
            )
        if isinstance(self.gpus, list) and len(set(self.gpus)) != len(self.gpus):
            raise ValueError(f"learner.gpus lists a GPU twice: {self.gpus}")
        return self

    @property
    def updates_per_batch(self) -> int:
        """Optimiser updates taken on each training batch."""
        return self.batch_groups // self.mini_batch_groups


class EvalConfig(_Component):
    """Held-out evaluation of published versions, in a process of its own (`streamrl eval`)."""

    dataset: DataConfig | None = Field(
        None,
        description="Validation prompts; fields left unset are taken from `data`, so "
        "eval.dataset.path=val.jsonl is enough. null: data.val_path, or when that is unset too "
        "the training prompts themselves (not held out: the evaluator warns and marks its "
        "records held_out=false).",
    )
    every_versions: int = Field(
        0,
        ge=0,
        le=MAX_STEPS,
        description="E: evaluate every E-th published version, and the last one; 0 starts no "
        "evaluator.",
    )
    k: int = Field(
        4,
        ge=1,
        le=4096,
        description="Samples per prompt for val/avg@k (mean accuracy of k samples).",
    )
    max_prompts: int = Field(
        64,
        ge=1,
        le=100_000_000,
        description="Evaluate the first this many validation prompts (file order).",
    )
    temperature: float | None = Field(
        None,
        gt=0.0,
        description="Sampling temperature of val/avg@k; null: generator.temperature. "
        "val/acc_greedy always decodes greedily.",
    )
    cpu_cores: CoreSetting = Field(
        None,
        description="CPU cores of the evaluator: a count or a core list such as '6-7'. null: a "
        "share of what the learner leaves, like a generator's.",
    )


class StorageConfig(_Component):
    """Where the run lives: a local directory or an s3:// prefix."""

    run_uri: str = Field(
        "./runs/default",
        min_length=1,
        description="Root of the run: ./runs/<name> or s3://bucket/prefix/<name>.",
    )
    endpoint_url: str | None = Field(
        None,
        description="S3 endpoint for S3-compatible stores (SeaweedFS, MinIO); default AWS or "
        "AWS_ENDPOINT_URL.",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra fsspec/s3fs options, such as client_kwargs: {region_name: ...}. Not "
        "credentials (refused): those come from the environment, AWS_ACCESS_KEY_ID / "
        "AWS_SECRET_ACCESS_KEY, or an AWS profile.",
    )
    compression: Literal["zstd", "blosc", "none"] = Field(
        "blosc",
        description="Codec for replay-stream segments: blosc (zstd with byte shuffle; smaller "
        "and faster on token/log-prob arrays), zstd, or none.",
    )
    compression_level: int = Field(3, ge=0, le=22, description="Codec level.")
    sweep_grace_s: float = Field(
        3600.0,
        ge=MIN_SWEEP_GRACE_S,
        le=MAX_WAIT_S,
        description="Uncommitted segments older than this are garbage. At least the writers' "
        "commit deadline plus a margin (storage.stream_sweep), so a segment that can still be "
        "committed is never removed.",
    )
    stream_retention: Literal["keep", "consumed"] = Field(
        "keep",
        description="keep: every stream segment stays (the run stays auditable). consumed: "
        "after each checkpoint the learner deletes the segments wholly before the oldest "
        "stored checkpoint's cursor, keeping their commit records (storage.stream_retention).",
    )


class WeightsConfig(_Component):
    """How the learner publishes policy versions and generators load them (storage.weights).

    Each learner rank uploads its own FSDP shard of every parameter in `dtype`; rank 0 commits
    the version once every rank's share is there. Publishing runs in the background: the step
    that publishes copies this rank's shard to host memory and training goes on while it is
    uploaded; the next publish waits for the previous one (versions commit in order, never
    skipped). Host memory per rank: two copies of its shard in `dtype` (the version being
    uploaded and the base of the next delta) plus up to 1 GiB of serialised files.
    """

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Dtype of published weights; auto: model.dtype, what the generators run "
        "(float32 keeps exact importance ratios on CPU).",
    )
    full_every: int = Field(
        8,
        ge=1,
        le=MAX_STEPS,
        description="A full version at least every N versions; the ones between are deltas "
        "against the previous version (the elements that changed). 1: full versions only.",
    )
    max_delta_ratio: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="A delta larger than this fraction of a full version is published full.",
    )
    background: bool = Field(
        True,
        description="Upload while the next step trains (false: the step waits for the upload).",
    )
    publish_timeout_s: float = Field(
        600.0,
        gt=0.0,
        le=MAX_WAIT_S,
        description="Rank 0 gives up on a version whose shares are not all in.",
    )
    publish_attempts: int = Field(
        3,
        ge=1,
        le=20,
        description="Uploads (and commits) of one version before the learner fails naming the "
        "storage error (retries after 2 s, 4 s, ... of back-off); a version is never skipped.",
    )
    shard_bytes: int = Field(
        512 * 1024**2,
        gt=0,
        le=1 << 40,
        description="Largest safetensors file a rank writes per version.",
    )
    keep_versions: int = Field(
        3,
        ge=1,
        le=10_000,
        description="Published versions retained, plus the versions a kept delta is built "
        "from (LATEST is never deleted).",
    )

    def resolved_dtype(self, model: ModelConfig) -> str:
        """The dtype versions are published in (a torch dtype name)."""
        return model.dtype if self.dtype == "auto" else self.dtype


class PlacementConfig(_Component):
    """Where the run's processes run: all on this machine, or each on a Prefect work pool."""

    mode: Literal["local", "pools"] = Field(
        "local",
        description="local: the learner, generators and evaluator are processes of the "
        "supervising process, placed on this machine's cores and GPUs (streamrl.placement). "
        "pools: the streamrl flow starts each as its own flow run of the learner, generator "
        "and evaluator deployments on the work pools below (flows.pools).",
    )
    learner_pool: str = Field(
        "learner", min_length=1, description="Work pool of the learner's flow runs (pools)."
    )
    generator_pool: str = Field(
        "generators", min_length=1, description="Work pool of the generators' flow runs (pools)."
    )
    eval_pool: str | None = Field(
        None, description="Work pool of the evaluator's flow run (pools); null: generator_pool."
    )
    image: str | None = Field(
        None,
        description="Container image passed to every flow run as the `image` job variable "
        "(pools whose template has one, such as Kubernetes); null: the pool's default.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables added to every flow run's `env` job variable. Not "
        "credentials (AWS_*, *_KEY, *TOKEN*, *SECRET*, *PASSWORD* are refused): those belong "
        "in the pool's Kubernetes secret or the worker's environment.",
    )
    retry_window_s: float = Field(
        3600.0,
        gt=0.0,
        le=MAX_WAIT_S,
        description="A generator's replacements are counted over this sliding window: "
        "generator_retries replacements within it fail the run, fewer spread over days do not "
        "(a spot fleet losing nodes now and then keeps going).",
    )
    max_generators: int = Field(
        64,
        ge=1,
        le=100_000,
        description="The most generators a scaling request (`streamrl scale`, "
        "control/fleet.json) may start; a larger request is refused by `streamrl scale` and "
        "capped at this by the supervising flow.",
    )

    @property
    def pools(self) -> bool:
        return self.mode == "pools"

    @property
    def evaluator_pool(self) -> str:
        return self.eval_pool or self.generator_pool


class LoggingConfig(_Component):
    """Metrics and logs: wandb, a JSONL file in the run, the console."""

    wandb_mode: Literal["auto", "online", "offline", "disabled"] = Field(
        "auto", description="auto: online when WANDB_API_KEY is set, else offline."
    )
    wandb_project: str = Field("streamrl", min_length=1, description="wandb project.")
    wandb_entity: str | None = Field(None, description="wandb entity (team or user).")
    run_name: str | None = Field(
        None, description="Display name; default: the last component of storage.run_uri."
    )
    log_every: int = Field(1, ge=1, le=MAX_STEPS, description="Log metrics every N learner steps.")
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Console log level."
    )


class HealthConfig(_Component):
    """Training-health conditions checked on every learner step (`streamrl.health`): one that
    becomes true logs a warning and is recorded in the step's metrics (the flow turns it into a
    Prefect event). The defaults are alarm levels, not limits: nothing is stopped.
    non-finite-update (any skipped update) and staleness-at-bound (learner.max_staleness) have
    no threshold of their own."""

    enabled: bool = Field(
        True, description="Check the conditions each step; false: no health warnings or events."
    )
    baseline_steps: int = Field(
        5,
        ge=1,
        le=MAX_STEPS,
        description="entropy-collapse: the run's first this-many steps give the entropy "
        "baseline (their mean actor/entropy).",
    )
    entropy_collapse_ratio: float = Field(
        0.2,
        gt=0.0,
        lt=1.0,
        description="entropy-collapse: actor/entropy below this fraction of its baseline. A "
        "drop by 5x means the policy has nearly stopped exploring (what DAPO's clip-higher "
        "guards against); some fall is normal as it learns.",
    )
    entropy_min: float = Field(
        0.02,
        ge=0.0,
        description="entropy-collapse: actor/entropy (nats per token) below this, whatever the "
        "baseline: a near-deterministic policy; 0 keeps only the ratio rule.",
    )
    kl_max: float = Field(
        0.1,
        gt=0.0,
        description="kl-high: actor/ref_kl (the behaviour policy's token-mean KL to the "
        "reference, logged when algorithm.kl is set) above this many nats: the policy has "
        "drifted far from the reference.",
    )
    grad_norm_spike: float = Field(
        5.0,
        gt=1.0,
        description="grad-norm-spike: actor/grad_norm above this multiple of the median of "
        "the previous grad_norm_window steps (checked once 5 are known): one batch pushed "
        "far harder than usual, a common first sign of instability.",
    )
    grad_norm_window: int = Field(
        20,
        ge=5,
        le=1_000_000,
        description="grad-norm-spike: how many previous steps' gradient norms the median "
        "is taken over.",
    )
    length_frac: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="length-runaway: rollout/response_len_mean at or above this fraction of "
        "generator.max_tokens: responses are running into the length limit (truncation, "
        "overlong penalties).",
    )
    waste_max: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="waste-high: stream/waste_frac (of every group consumed so far, the share "
        "not trained on: stale, or without signal under dynamic sampling) above this; 1 never "
        "fires.",
    )


class RunConfig(_Component):
    """Everything one streamrl run needs; written once to `<run>/run.json`."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy model.")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompt dataset.")
    generator: GeneratorConfig = Field(
        default_factory=GeneratorConfig, description="Sampling, scoring, stream writing."
    )
    learner: LearnerConfig = Field(
        default_factory=LearnerConfig, description="Training, publishing, checkpoints."
    )
    eval: EvalConfig = Field(
        default_factory=EvalConfig, description="Held-out evaluation of published versions."
    )
    algorithm: AlgorithmConfig = Field(
        default_factory=DAPOConfig, description="The RL algorithm (discriminated by name)."
    )
    storage: StorageConfig = Field(
        default_factory=StorageConfig, description="Run location and storage options."
    )
    weights: WeightsConfig = Field(
        default_factory=WeightsConfig, description="Publishing and loading policy versions."
    )
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Metrics sinks.")
    health: HealthConfig = Field(
        default_factory=HealthConfig,
        description="Training-health conditions checked each learner step, with thresholds.",
    )
    placement: PlacementConfig = Field(
        default_factory=PlacementConfig,
        description="Where the processes run: this machine or Prefect work pools.",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_algorithm_name(cls, data: Any) -> Any:
        """`algorithm: {clip_high: 0.3}` without a name refines the default algorithm (dapo)."""
        if isinstance(data, dict) and isinstance(data.get("algorithm"), dict):
            data = {**data, "algorithm": {"name": DAPOConfig().name, **data["algorithm"]}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _eval_dataset_inherits_data(cls, data: Any) -> Any:
        """`eval: {dataset: {path: val.jsonl}}` keeps the run's prompt fields, chat template and
        lengths: every field the eval dataset does not set comes from `data` (but val_path)."""
        if not isinstance(data, dict) or not isinstance(data.get("eval"), dict):
            return data
        dataset = data["eval"].get("dataset")
        if not isinstance(dataset, dict):
            return data
        base = data.get("data") or {}
        if isinstance(base, BaseModel):
            base = base.model_dump(exclude_unset=True)
        inherited = (
            {k: v for k, v in base.items() if k != "val_path"} if isinstance(base, dict) else {}
        )
        return {**data, "eval": {**data["eval"], "dataset": {**inherited, **dataset}}}

    @model_validator(mode="after")
    def _value_model_matches_algorithm(self) -> RunConfig:
        name = self.algorithm.name
        if self.algorithm.uses_value_model and self.model.critic is None:
            raise ValueError(
                f"algorithm '{name}' trains a value model but model.critic is not set; set "
                "model.critic.init_from=policy (or a reward-model path)"
            )
        if not self.algorithm.uses_value_model and self.model.critic is not None:
            raise ValueError(
                f"model.critic is set but algorithm '{name}' uses no value model; remove "
                "model.critic or use algorithm.name=vapo"
            )
        return self

    @model_validator(mode="after")
    def _several_nodes_need_pools(self) -> RunConfig:
        if self.learner.nnodes > 1 and not self.placement.pools:
            raise ValueError(
                f"learner.nnodes={self.learner.nnodes} needs placement.mode=pools (each node is "
                "a flow run on placement.learner_pool); on one machine use "
                "learner.nproc_per_node instead"
            )
        return self

    @model_validator(mode="after")
    def _groups_are_large_enough(self) -> RunConfig:
        alg = self.algorithm
        if (alg.needs_groups or alg.dynamic_sampling) and self.generator.group_size < 2:
            why = "its advantage compares responses within a group"
            if not alg.needs_groups:
                why = "dynamic sampling needs groups of several responses"
            raise ValueError(
                f"generator.group_size must be ≥ 2 for algorithm '{alg.name}' ({why}); "
                f"got {self.generator.group_size}"
            )
        return self

    @model_validator(mode="after")
    def _lengths_fit(self) -> RunConfig:
        longest = self.data.max_prompt_len + self.generator.max_tokens
        if longest > self.model.max_model_len:
            raise ValueError(
                f"data.max_prompt_len ({self.data.max_prompt_len}) + generator.max_tokens "
                f"({self.generator.max_tokens}) = {longest} exceeds model.max_model_len "
                f"({self.model.max_model_len}); raise model.max_model_len or shorten one of them"
            )
        if self.learner.micro_batch_tokens < longest:
            raise ValueError(
                f"learner.micro_batch_tokens ({self.learner.micro_batch_tokens}) must hold the "
                f"longest sequence (data.max_prompt_len + generator.max_tokens = {longest}); "
                f"set learner.micro_batch_tokens ≥ {longest}"
            )
        if self.eval.dataset is not None:
            longest_eval = self.eval.dataset.max_prompt_len + self.generator.max_tokens
            if longest_eval > self.model.max_model_len:
                raise ValueError(
                    f"eval.dataset.max_prompt_len ({self.eval.dataset.max_prompt_len}) + "
                    f"generator.max_tokens ({self.generator.max_tokens}) = {longest_eval} exceeds "
                    f"model.max_model_len ({self.model.max_model_len}); lower "
                    "eval.dataset.max_prompt_len or raise model.max_model_len"
                )
        cache = self.algorithm.overlong.cache_len
        if cache is not None and cache > self.generator.max_tokens:
            raise ValueError(
                f"algorithm.overlong.cache_len ({cache}) must be ≤ generator.max_tokens "
                f"({self.generator.max_tokens})"
            )
        return self

    @property
    def overlong_cache_len(self) -> int:
        """L_cache in tokens: as configured, else L_max / 5 (DAPO), at least 1."""
        configured = self.algorithm.overlong.cache_len
        return configured if configured is not None else max(1, self.generator.max_tokens // 5)

    @property
    def run_name(self) -> str:
        """Display name of the run."""
        return self.logging.run_name or self.storage.run_uri.rstrip("/").rsplit("/", 1)[-1]

    def to_yaml(self) -> str:
        """The full, resolved configuration as YAML (loads back to an equal RunConfig)."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


# --------------------------------------------------------------------------------------------
# Loading: presets, files, overrides, errors
# --------------------------------------------------------------------------------------------


class ConfigError(ValueError):
    """A configuration the user must fix. `problems` holds one line per problem."""

    def __init__(self, problems: Sequence[str], source: str = "configuration") -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid {source}:\n{lines}")


def available_presets() -> list[str]:
    """Names of the presets shipped with streamrl."""
    folder = resources.files("streamrl") / "presets"
    return sorted(
        p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml")
    )


def _read_yaml(path: Path | Any, what: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError([_yaml_problem(path, exc)]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"{what} must hold a mapping of sections, got {type(data).__name__}"])
    return data


def _yaml_problem(path: Path | Any, exc: yaml.YAMLError) -> str:
    """`<file>:<line>:<column>: <problem>`. Never PyYAML's own message: it quotes the
    offending line, which may hold a secret."""
    mark = getattr(exc, "problem_mark", None)
    if isinstance(exc, yaml.reader.ReaderError):
        return f"{path}: not valid YAML: {exc.reason} (character {exc.position + 1})"
    if mark is None:
        return f"{path}: not valid YAML ({type(exc).__name__})"
    context = getattr(exc, "context", None)
    problem = getattr(exc, "problem", None) or "not valid YAML"
    where = f"{path}:{mark.line + 1}:{mark.column + 1}"
    return f"{where}: not valid YAML: {f'{context}, ' if context else ''}{problem}"


def _load_layer(ref: str, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """A preset name or YAML path, with its `extends:` chain resolved (parents first)."""
    if ref in seen:
        raise ConfigError([f"presets extend each other in a cycle: {' -> '.join((*seen, ref))}"])
    path = Path(ref)
    if path.suffix in {".yaml", ".yml"} or path.exists():
        if not path.is_file():
            raise ConfigError([f"config file {ref} does not exist"])
        data = _read_yaml(path, f"config file {ref}")
    else:
        preset = resources.files("streamrl") / "presets" / f"{ref}.yaml"
        if not preset.is_file():
            close = difflib.get_close_matches(ref, available_presets(), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(
                [f"unknown preset '{ref}'{hint} Available: {', '.join(available_presets())}"]
            )
        data = _read_yaml(preset, f"preset {ref}")
    parents = data.pop("extends", []) or []
    if isinstance(parents, str):
        parents = [parents]
    merged: dict[str, Any] = {}
    for parent in parents:
        merged = deep_merge(merged, _load_layer(parent, (*seen, ref)))
    return deep_merge(merged, data)


CREDENTIAL_OVERRIDE = (
    rf"(?i)^(?:[^=]*\.)?\s*{CREDENTIAL_NAME}\s*[.=]"
    rf"|^\s*(?:storage|placement)\b[^=]*=.*?(?<![\w-])[\"']?{CREDENTIAL_NAME}[\"']?\s*:"
)
"""An override that sets a credential: one whose dotted key names one
(`placement.env.HF_TOKEN=...`), or a storage/placement mapping with such a key
(`storage.storage_options={secret: ...}`). The deployments' parameter schema refuses it, so the
Prefect server refuses the flow run before storing its parameters; in the flow,
`parse_overrides` refuses every credential, naming its path."""

Override = Annotated[
    str,
    Field(
        description="A dotted override, section.field=value (learner.lr=1e-6); never a "
        "credential: those are refused (give them to the workers as environment variables or a "
        "Kubernetes secret).",
        json_schema_extra={"not": {"pattern": CREDENTIAL_OVERRIDE}},
    ),
]


def parse_overrides(overrides: Iterable[str]) -> dict[str, Any]:
    """`["learner.lr=1e-6", "generator.stop=[A, B]"]` → nested dict; values parsed as YAML.

    An override that sets a credential (`placement.env.HF_TOKEN=...`,
    `storage.storage_options={secret: ...}`) is refused, naming its path, never its value."""
    nested: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
            raise ConfigError(
                [f"override {item!r} must look like section.field=value, e.g. learner.lr=1e-6"]
            )
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = nested
        *parents, leaf = key.strip().split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError([f"override {item!r} conflicts with an earlier one for {part}"])
            node = child
        node[leaf] = value
    if found := credential_paths(nested):
        raise ConfigError([_credentials_problem(found)], "overrides")
    return nested


def load_config(
    presets: Sequence[str] = (),
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
) -> RunConfig:
    """Build and validate a RunConfig: defaults ← presets ← YAML file ← dotted overrides.

    Raises `ConfigError` listing every problem, each with the field's dotted name.
    """
    merged: dict[str, Any] = {}
    for name in presets:
        merged = deep_merge(merged, _load_layer(name))
    if path is not None:
        merged = deep_merge(merged, _load_layer(str(path)))
    merged = deep_merge(merged, parse_overrides(overrides))
    return validate_config(merged)


def validate_config(data: Mapping[str, Any], source: str = "configuration") -> RunConfig:
    """Validate a (merged) config mapping; raise `ConfigError` with user-facing messages."""
    try:
        return RunConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError([_describe(err) for err in exc.errors()], source) from None


def _model_at(
    loc: Sequence[str | int], root: type[BaseModel] | None = None
) -> type[BaseModel] | None:
    """The pydantic model holding the field at `loc`, for 'did you mean' suggestions."""
    model: type[BaseModel] = root or RunConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        candidates = [field.annotation, *getattr(field.annotation, "__args__", ())]
        nested = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
        if not nested:
            return None
        model = nested[0]
    return model


def _describe(err: Mapping[str, Any]) -> str:
    """One pydantic error → 'section.field: what is wrong; how to fix it'."""
    loc = list(err["loc"])
    owner: type[BaseModel] | None
    # The algorithm union puts its tag in the location: ('algorithm', 'dapo', 'clip_high').
    if len(loc) >= 2 and loc[0] == "algorithm" and loc[1] in ALGORITHM_NAMES:
        tag = str(loc.pop(1))
        owner = _model_at(loc[1:], ALGORITHM_CLASSES[tag])
        context = f" (algorithm '{tag}')"
    else:
        owner = _model_at(loc) if loc else None
        context = ""
    # Drop pydantic's internal location parts (function-after[...], union members).
    loc = [p for p in loc if not (isinstance(p, str) and ("[" in p or p.startswith("function")))]
    where = ".".join(str(p) for p in loc) or "configuration"
    kind = err["type"]
    if kind == "extra_forbidden":
        field = str(loc[-1]) if loc else where
        valid = sorted(owner.model_fields) if owner is not None else []
        close = difflib.get_close_matches(field, valid, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        listing = f" Valid fields: {', '.join(valid)}." if valid else ""
        return f"{where}: unknown field{context}.{hint}{listing}"
    if kind == "union_tag_invalid":
        tag = err.get("ctx", {}).get("tag")
        close = difflib.get_close_matches(str(tag), ALGORITHM_NAMES, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        return f"{where}.name: unknown algorithm {tag!r}.{hint} Choose one of: " + ", ".join(
            ALGORITHM_NAMES
        )
    if kind == "union_tag_not_found":
        return f"{where}: missing 'name'; choose one of: {', '.join(ALGORITHM_NAMES)}"
    message = err["msg"].removeprefix("Value error, ")
    if kind == "value_error" and where == "configuration":
        return message
    value = err.get("input")
    shown = "" if isinstance(value, dict) or kind == "missing" else f" (got {value!r})"
    return f"{where}: {message}{context}{shown}"
