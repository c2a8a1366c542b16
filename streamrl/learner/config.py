"""The learner's sections: `learner` (batching, optimiser, staleness, checkpoints, ranks),
`weights` (how it publishes versions: `streamrl.learner.publish`) and `logging` (where its
metrics go: `streamrl.learner.reporting`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from streamrl.config.base import (
    MAX_SEED,
    MAX_SEQUENCE_TOKENS,
    MAX_STEPS,
    MAX_WAIT_S,
    AdamBeta,
    CoreSetting,
    Section,
)
from streamrl.models.config import ModelConfig

__all__ = [
    "HealthConfig",
    "LearnerConfig",
    "LoggingConfig",
    "Schedule",
    "SupervisedConfig",
    "WeightsConfig",
]

Schedule = Literal["constant", "cosine", "warmup-times-cosine"]
"""The learning-rate schedules (`streamrl.learner.optim.lr_factor`)."""


class LearnerConfig(Section):
    """The FSDP2 learner: batching, optimiser, staleness, publishing and checkpoints."""

    total_steps: int = Field(
        100, ge=1, le=MAX_STEPS, description="Step budget; the run ends after it."
    )
    batch_groups: int = Field(
        16, ge=1, le=1_000_000, description="B: accepted groups (prompts) per training batch."
    )
    batch_tokens: int | None = Field(
        None,
        gt=0,
        le=2**40,
        description="Length-aware batches (the framework guide's Alg. 3): also close a batch "
        "once its accepted groups hold this many response tokens (the group that reaches it "
        "included), so a batch of long responses has fewer groups; null: B groups always.",
    )
    mini_batch_groups: int = Field(
        16,
        ge=1,
        le=1_000_000,
        description="Groups per optimiser update; batch_groups / mini_batch_groups updates "
        "per batch (a batch closed early by batch_tokens: its groups in runs of "
        "mini_batch_groups, the last run shorter).",
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
        10,
        ge=0,
        le=MAX_STEPS,
        description="Linear learning-rate warm-up, in optimiser updates (batch_groups / "
        "mini_batch_groups of them per learner step); at most the run's updates, "
        "total_steps × batch_groups / mini_batch_groups.",
    )
    schedule: Schedule = Field(
        "constant",
        description="Learning-rate schedule: constant or cosine after the linear warm-up; "
        "warmup-times-cosine, the framework guide's eq 57: lr·min(1, t/warmup_steps)·"
        "cos(π·t/(2·total_steps)), the warm-up multiplying a quarter cosine that runs from "
        "the first update and reaches 0 at the last (min_lr_ratio unused).",
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
    checkpoint_on_stop: bool = Field(
        True,
        description="On SIGTERM or Ctrl-C (a preempted spot machine, a supervisor stopping the "
        "run): finish the step in hand (or abandon its wait for data) and commit a checkpoint "
        "of it before exiting, so a resume loses no step. false: stop at once, resuming from "
        "the last periodic checkpoint.",
    )
    stop_grace_s: float = Field(
        25.0,
        gt=0.0,
        le=MAX_WAIT_S,
        description="Seconds a stopped learner has before it is killed (Kubernetes: the pod's "
        "terminationGracePeriodSeconds, 30 by default; keep this below it). A checkpoint on "
        "stop that would not fit in what is left of it is not started (it would be cut off "
        "half-way, never committed), and a supervisor of this run waits this long, plus a "
        "margin, before SIGKILL.",
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
        "'0-3,8' (a bare number is a count). null: every core the run may use, engines running "
        "on them at background priority (see streamrl.placement).",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto picks CUDA when available."
    )
    gpu_memory_fraction: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description="On a GPU shared with engines (placement.share_gpus): the share of its "
        "memory the learner may take (its allocator is capped there). null: its estimated "
        "need plus a quarter, the engines the rest (streamrl.placement.gpu_memory).",
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
    attention: Literal["auto", "sdpa", "flex_attention"] = Field(
        "auto",
        description="The attention kernel of the learner's forward passes. sdpa: PyTorch's "
        "scaled_dot_product_attention (shared-prompt rows with a dense mask); flex_attention: "
        "FlexAttention with a block mask, computing only the blocks each row's prompt and "
        "responses touch (CUDA only: it has no backward on CPU). auto: sdpa.",
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
    def _warmup_ends_within_the_run(self) -> LearnerConfig:
        """The schedule (`streamrl.learner.optim.build_scheduler`) counts optimiser updates and
        refuses a warm-up longer than the run: the peak lr would never be reached."""
        updates = self.total_steps * self.updates_per_batch
        if self.warmup_steps <= updates:
            return self
        run = f"total_steps ({self.total_steps})"
        if self.updates_per_batch > 1:
            run = (
                f"the run's optimiser updates, {run} × {self.updates_per_batch} per step "
                f"(batch_groups / mini_batch_groups) = {updates}"
            )
        raise ValueError(
            f"warmup_steps ({self.warmup_steps}) exceeds {run}: the peak learning rate would "
            f"never be reached; set learner.warmup_steps ≤ {updates} or raise "
            "learner.total_steps"
        )
        return self

    @model_validator(mode="after")
    def _flex_attention_on_cuda(self) -> LearnerConfig:
        if self.attention == "flex_attention" and self.device == "cpu":
            raise ValueError(
                "learner.attention=flex_attention needs learner.device=cuda (FlexAttention has no "
                "backward pass on CPU); set learner.attention=sdpa or auto"
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


class WeightsConfig(Section):
    """How the learner publishes policy versions (`storage.weights.publish`) and generators load
    them (`storage.weights.versions`).

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
    lora_publish: Literal["adapter", "merged"] = Field(
        "adapter",
        description="With model.lora: publish the adapter alone (MBs; generators load it in "
        "place under one adapter id) or merged full weights (for engines where adapters are "
        "slow; generators load them as without LoRA).",
    )
    handoff: bool | None = Field(
        None,
        description="Generators beside the learner take each version from its memory instead "
        "of storage (storage is still written, for resume and every other reader). null "
        "(default): the generators that share a GPU with the learner (CUDA IPC, device to "
        "device). true: also every other generator on the learner's machine (host shared "
        "memory). false: always storage. Not with LoRA adapters (weights.lora_publish=adapter).",
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

    def hands_off(self, model: ModelConfig, shares_gpu: bool) -> bool:
        """Whether a generator beside the learner takes versions from its memory
        (`handoff`): `shares_gpu`, it holds one of the learner's GPUs."""
        if self.handoff is False or (model.lora is not None and self.lora_publish == "adapter"):
            return False
        return self.handoff is True or shares_gpu


class LoggingConfig(Section):
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
    log_samples: int = Field(
        4,
        ge=0,
        le=64,
        description="Responses of the batch a logged step trained on, decoded into a wandb table "
        "(`samples`: prompt, turns, tool calls, reward, versions) and the flow's samples "
        "artifact, each text cut to 2000 characters; 0: no table (docs/samples.md).",
    )
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Console log level."
    )


class HealthConfig(Section):
    """Training-health conditions checked on every learner step (`streamrl.learner.health`): one
    that becomes true logs a warning and is recorded in the step's metrics (the flow turns it into a
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
    mismatch_kl_max: float = Field(
        0.01,
        gt=0.0,
        description="mismatch-high: mismatch/kl_k3_fresh (the k3 KL between the generator's "
        "and the learner's log-probs over fresh groups, generated by the weights the learner "
        "holds) above this many nats per token: the engines disagree beyond precision noise "
        "(fp32 on both sides gives ≈ 0; bf16 sampling typically 1e-4 to 1e-3) — check the "
        "sampling settings, dtype and weight sync before the gap derails training.",
    )
    tools_unused_steps: int = Field(
        10,
        ge=1,
        le=MAX_STEPS,
        description="tools-unused: rollout/tool_calls_mean at 0 for this many steps in a row "
        "while the environment offers tools: the model never calls its tools, so there is "
        "no tool use to reinforce (warm-start it on demonstrations, or show a worked call "
        "in the prompt).",
    )


class SupervisedConfig(Section):
    """Supervised fine-tuning (`streamrl.learner.supervised`): the run's learner trains on the
    chat conversations of `data.path` (held-out loss on `data.val_path`) instead of a replay
    stream; no generator runs. Batching, optimiser, checkpoints, publishing and LoRA are the
    learner's own (`learner.batch_groups` conversations a step, packed to
    `learner.micro_batch_tokens`); the loss is the token-mean negative log-likelihood of the
    assistant's tokens."""

    messages_field: str = Field(
        "messages",
        min_length=1,
        description="Field with the conversation: a list of chat messages (OpenAI / Hugging "
        "Face layout: system, user, assistant with content and tool_calls, tool). Dotted "
        "paths reach into nested fields.",
    )
    tools: Literal["row", "environment"] = Field(
        "row",
        description="The tools a conversation offers the model. row: each row's tools_field "
        "(OpenAI function schemas; none where absent). environment: the tools of "
        "generator.env.fn (a registered environment listing them), as its RL episodes show "
        "them. Calls and tool results are written in generator.env.tool_format.",
    )
    tools_field: str = Field(
        "tools", min_length=1, description="Field with a row's tool schemas (tools=row)."
    )
    eval_every: int = Field(
        10,
        ge=0,
        le=MAX_STEPS,
        description="Held-out loss on data.val_path every this many steps and at the last; "
        "0: never.",
    )
    eval_conversations: int = Field(
        256,
        ge=1,
        le=1_000_000,
        description="Held-out conversations the loss is computed on (the first this many).",
    )
