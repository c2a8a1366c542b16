"""The run's configuration: every component's section joined in `RunConfig`, with the rules
that span components, and `storage`, where the run lives.

Each section is defined, read and validated beside its component:

    model       streamrl.models.config         ModelConfig, CriticConfig (model.critic)
    data        streamrl.data.config           DataConfig (eval.dataset too)
    generator   streamrl.generator.config      GeneratorConfig
                streamrl.rewards.config        RewardConfig (generator.reward)
    learner     streamrl.learner.config        LearnerConfig
    weights     streamrl.learner.config        WeightsConfig
    logging     streamrl.learner.config        LoggingConfig
    eval        streamrl.evaluation.config     EvalConfig
    algorithm   streamrl.algorithms.config     one class per algorithm (by `name`)
    placement   streamrl.placement.config      one class per mode (`local` | `pools`)
    scorers     streamrl.scorers.config        ScorerConfig per name (teacher, reward model, judge)
    health      streamrl.learner.health                HealthConfig
    storage     here                           StorageConfig

`streamrl.config.loading` builds a `RunConfig` from presets, files and dotted overrides and
turns validation errors into `ConfigError`s that name the field and the fix.
"""

from __future__ import annotations

from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, model_validator

from storage.stream.sweep import min_sweep_grace_s
from streamrl.algorithms.config import AlgorithmConfig, DAPOConfig
from streamrl.algorithms.preference_config import PreferenceConfig
from streamrl.config.base import MAX_WAIT_S, ConfigError, Section
from streamrl.data.config import DataConfig
from streamrl.evaluation.config import EvalConfig
from streamrl.generator.config import GeneratorConfig
from streamrl.learner.config import (
    HealthConfig,
    LearnerConfig,
    LoggingConfig,
    SupervisedConfig,
    WeightsConfig,
)
from streamrl.models.config import ModelConfig
from streamrl.models.lora import LoraConfig
from streamrl.placement.config import LocalPlacement, PlacementConfig
from streamrl.scorers.config import ScorerConfig, check_scorer_name

__all__ = ["RunConfig", "StorageConfig"]

MIN_SWEEP_GRACE_S = min_sweep_grace_s()


class StorageConfig(Section):
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
        "commit deadline plus a margin (storage.stream.sweep), so a segment that can still be "
        "committed is never removed.",
    )
    stream_retention: Literal["keep", "consumed"] = Field(
        "keep",
        description="keep: every stream segment stays (the run stays auditable). consumed: "
        "after each checkpoint the learner deletes the segments wholly before the oldest "
        "stored checkpoint's cursor, keeping their commit records (storage.stream_retention).",
    )


class RunConfig(Section):
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
        default_factory=LocalPlacement,
        description="Where the processes run: this machine or Prefect work pools.",
    )
    sft: SupervisedConfig | None = Field(
        None,
        description="Supervised fine-tuning on chat conversations instead of RL: the learner "
        "alone, on data.path's conversations (null: an RL run).",
    )
    preference: PreferenceConfig | None = Field(
        None,
        description="Preference optimization (DPO, IPO, SimPO) on (prompt, chosen, rejected) "
        "pairs instead of RL: the learner alone, on data.path's pairs (null: not one).",
    )
    scorers: dict[str, ScorerConfig] = Field(
        default_factory=dict,
        description="The models that score, by name: a teacher (generator.teacher), reward "
        "models and judges — each an OpenAI-compatible endpoint, served by the run (vLLM, "
        "placed and supervised like a generator) or external (url).",
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
    def _default_placement_mode(cls, data: Any) -> Any:
        """`placement: {}` without a mode is a local placement."""
        if isinstance(data, dict) and isinstance(data.get("placement"), dict):
            data = {**data, "placement": {"mode": LocalPlacement().mode, **data["placement"]}}
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
        base = base if isinstance(base, dict) else {}
        inherited = {k: v for k, v in base.items() if k not in ("val_path", "source")}
        if "source" in base:  # data.source is data.path (it wins): a dataset's own path replaces it
            inherited["path"] = base["source"]
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
        if self.algorithm.uses_value_model and self.model.critic.init_from != "policy":
            refusal = self.algorithm.value_head.reward_model_refusal(self.model.critic.init_from)
            if refusal is not None:
                raise ValueError(refusal)
        return self

    @model_validator(mode="after")
    def _one_dataset_stage(self) -> RunConfig:
        if self.sft is not None and self.preference is not None:
            raise ValueError(
                "sft and preference are both set: a run is one stage (supervised or preference "
                "training); chain them in a recipe, one stage after the other"
            )
        return self

    @model_validator(mode="after")
    def _lora_reference_is_the_base(self) -> RunConfig:
        kl = self.algorithm.reference_kl
        if self.model.lora is not None and kl is not None and kl.reference == "ema":
            raise ValueError(
                "model.lora is set with algorithm.kl.reference=ema: a LoRA run's reference "
                "policy is the frozen base (the adapters switched off); set "
                "algorithm.kl.reference=frozen or remove model.lora"
            )
        return self

    @model_validator(mode="after")
    def _episodes_fit_the_model_and_algorithm(self) -> RunConfig:
        env = self.generator.env
        if not env.multi_turn:
            return self
        if (env.max_episode_tokens or 0) > self.model.max_model_len:
            raise ValueError(
                f"generator.env.max_episode_tokens ({env.max_episode_tokens}) exceeds "
                f"model.max_model_len ({self.model.max_model_len}); lower it or raise "
                "model.max_model_len"
            )
        episode = env.max_episode_tokens or self.model.max_model_len
        if self.learner.micro_batch_tokens < episode:
            raise ValueError(
                f"learner.micro_batch_tokens ({self.learner.micro_batch_tokens}) must hold the "
                f"longest episode (generator.env.max_episode_tokens, else model.max_model_len: "
                f"{episode}); set learner.micro_batch_tokens ≥ {episode}"
            )
        if not self.data.apply_chat_template:
            raise ValueError(
                f"generator.env.fn={env.fn} renders the environment's messages with the chat "
                "template, so the prompt must be rendered with it too; set "
                "data.apply_chat_template=true"
            )
        if self.algorithm.uses_value_model:
            raise ValueError(
                f"algorithm '{self.algorithm.name}' trains a value model, which multi-turn "
                f"episodes (generator.env.fn={env.fn}) do not support yet; use grpo, dr_grpo, "
                "dapo, rloo, reinforce_pp or gpg"
            )
        return self

    @model_validator(mode="after")
    def _scorers_are_named_and_used(self) -> RunConfig:
        for name in self.scorers:
            check_scorer_name(name)
        teacher, opd = self.generator.teacher, self.algorithm.opd
        if opd is not None and teacher is None:
            raise ValueError(
                "algorithm.opd (on-policy distillation) trains on a teacher's log-probs, but "
                "generator.teacher is not set: name a scorer, e.g. scorers.teacher.model=PATH "
                "and generator.teacher=teacher"
            )
        if teacher is None:
            return self
        if opd is None:
            raise ValueError(
                f"generator.teacher={teacher} scores every sampled token, but algorithm.opd is "
                "not set, so nothing would train on it: set algorithm.opd (e.g. "
                "algorithm.opd.lambda_rl=1.0) or generator.teacher=null"
            )
        scorer = self._named_scorer(teacher, "generator.teacher")
        if not scorer.served and scorer.tokenizer is None:
            raise ValueError(
                f"generator.teacher={teacher} is an external endpoint: set "
                f"scorers.{teacher}.tokenizer to its tokenizer's directory, so that streamrl "
                "can check it is the policy's (the teacher's log-probs are read at the "
                "policy's token ids)"
            )
        if scorer.task != "generate":
            raise ValueError(
                f"generator.teacher={teacher} is a {scorer.task} scorer; a teacher gives "
                f"log-probs, so scorers.{teacher}.task must be generate"
            )
        needed = self.model.max_model_len + 1
        if scorer.max_model_len is not None and scorer.max_model_len < needed:
            raise ValueError(
                f"scorers.{teacher}.max_model_len={scorer.max_model_len} cannot hold a whole "
                f"sequence (model.max_model_len={self.model.max_model_len}) and the token a "
                f"completion samples; set it ≥ {needed} or leave it null"
            )
        if self.generator.temperature != 1.0:
            raise ValueError(
                f"on-policy distillation compares the policy's sampling distribution with the "
                f"teacher's own, but generator.temperature={self.generator.temperature} tempers "
                "the behaviour log-probs the teacher's are set against; set "
                "generator.temperature=1.0"
            )
        if opd.lambda_rl == 0.0 and self.algorithm.dynamic_sampling:
            raise ValueError(
                "algorithm.opd.lambda_rl=0 distils only, but dynamic sampling drops the groups "
                "whose rewards are all equal, which still carry the teacher's signal; set "
                "algorithm.dynamic_sampling=false (or give the reward a weight, lambda_rl > 0)"
            )
        return self

    @model_validator(mode="after")
    def _reasoning_gym_tasks_score_with_their_reward(self) -> RunConfig:
        fn, procedural = self.generator.reward.fn, self.data.procedural
        if procedural and ":" not in fn and fn != "reasoning_gym":
            raise ValueError(
                f"data.path names reasoning-gym tasks, whose answers only their own scorers "
                f"read, but generator.reward.fn is {fn!r}; set generator.reward.fn=reasoning_gym"
            )
        if procedural and self.data.val_path is not None:
            raise ValueError(
                f"data.path names reasoning-gym tasks, which bring their own held-out split, but "
                f"data.val_path is {self.data.val_path!r}; set data.val_path=null (eval.dataset "
                "chooses other reasoning-gym tasks to evaluate on)"
            )
        if fn == "reasoning_gym" and not procedural:
            raise ValueError(
                f"generator.reward.fn=reasoning_gym scores reasoning-gym tasks, but data.path is "
                f"{self.data.path!r}; set data.path=reasoning_gym:<task>,... or another reward"
            )
        return self

    @model_validator(mode="after")
    def _reward_terms_name_their_scorers(self) -> RunConfig:
        for name, term in self.generator.reward.models.items():
            where = f"generator.reward.models.{name}.scorer"
            scorer = self._named_scorer(term.scorer, where)
            wanted = "classify" if term.kind == "reward_model" else "generate"
            if scorer.task != wanted:
                raise ValueError(
                    f"{where}={term.scorer} is a {scorer.task} scorer, but a {term.kind} term "
                    f"needs task {wanted}: set scorers.{term.scorer}.task={wanted}"
                )
        return self

    @model_validator(mode="after")
    def _served_scorers_are_used(self) -> RunConfig:
        used = {self.generator.teacher} | {t.scorer for t in self.generator.reward.models.values()}
        idle = [name for name in self.served_scorers if name not in used]
        if idle:
            raise ValueError(
                f"scorers {', '.join(idle)} would be served (cores, GPUs) but nothing uses "
                "them: name them in generator.teacher or generator.reward.models, or remove them"
            )
        return self

    @model_validator(mode="after")
    def _several_nodes_need_pools(self) -> RunConfig:
        if self.learner.nnodes > 1 and isinstance(self.placement, LocalPlacement):
            raise ValueError(
                f"learner.nnodes={self.learner.nnodes} needs placement.mode=pools (each node is "
                "a flow run on placement.learner_pool); on one machine use "
                "learner.nproc_per_node instead"
            )
        return self

    @model_validator(mode="after")
    def _groups_are_large_enough(self) -> RunConfig:
        alg = self.algorithm
        if (alg.needs_groups or alg.dynamic_sampling) and self.generator.smallest_group_size < 2:
            why = "its advantage compares responses within a group"
            if not alg.needs_groups:
                why = "dynamic sampling needs groups of several responses"
            raise ValueError(
                f"generator.group_size must be ≥ 2 for algorithm '{alg.name}' ({why}); "
                f"got {self.generator.group_size} (or turn on generator.adaptive_group, whose "
                "groups have at least min_size ≥ 2)"
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

    @model_validator(mode="after")
    def _one_length_shaping(self) -> RunConfig:
        penalty = self.algorithm.length_penalty
        if penalty is None:
            return self
        if self.algorithm.overlong.shaping:
            raise ValueError(
                "algorithm.length_penalty and algorithm.overlong.shaping both shape the reward by "
                "length; the adaptive length penalty is an alternative to overlong shaping: set "
                "one (algorithm.overlong.shaping=false, or algorithm.length_penalty=null)"
            )
        target, longest = penalty.target, self.generator.max_tokens
        if target is not None and target > longest and not self.generator.env.multi_turn:
            raise ValueError(
                f"algorithm.length_penalty.target ({target}) must be ≤ generator.max_tokens "
                f"({longest}), the longest a single-turn response can be; lower it (for a "
                "milder penalty, lower algorithm.length_penalty.lambda_base)"
            )
        return self

    @property
    def overlong_cache_len(self) -> int:
        """L_cache in tokens: as configured, else L_max / 5 (DAPO), at least 1."""
        configured = self.algorithm.overlong.cache_len
        return configured if configured is not None else max(1, self.generator.max_tokens // 5)

    @property
    def length_penalty_target(self) -> int:
        """L_target of the adaptive length penalty in tokens: as configured, else
        generator.max_tokens / 2, at least 1."""
        penalty = self.algorithm.length_penalty
        configured = penalty.target if penalty is not None else None
        return configured if configured is not None else max(1, self.generator.max_tokens // 2)

    @property
    def served_adapter(self) -> LoraConfig | None:
        """The LoRA adapter generators serve on the base model: `model.lora` when versions are
        adapters (`weights.lora_publish=adapter`); None when they are whole models."""
        if self.model.lora is not None and self.weights.lora_publish == "adapter":
            return self.model.lora
        return None

    def _named_scorer(self, name: str, where: str) -> ScorerConfig:
        """The scorer `where` names, or a ValueError saying how to add it."""
        scorer = self.scorers.get(name)
        if scorer is None:
            known = ", ".join(sorted(self.scorers)) or "none"
            raise ValueError(
                f"{where}={name} names no scorer (scorers: {known}); add "
                f"scorers.{name}.model=PATH (served by the run) or scorers.{name}.url=URL"
            )
        return scorer

    def scorer_context(self, name: str) -> int | None:
        """The context length served scorer `name` is started with (vLLM --max-model-len):
        its own setting, else model.max_model_len + 1 for the teacher (whole sequences plus
        the one token a completion samples), else None (the model's own)."""
        configured = self.scorers[name].max_model_len
        if configured is not None or name != self.generator.teacher:
            return configured
        return self.model.max_model_len + 1

    def generators_to_start(self, requested: int | None = None) -> int:
        """How many generators the run starts: `requested`, else generator.count; none for a
        supervised run (`sft`), which trains on its dataset.

        Raises:
            ConfigError: generators requested for a supervised run.
        """
        if not self.learner_only:
            return self.generator.count if requested is None else requested
        if requested:
            raise ConfigError(
                [f"{requested} generator(s) asked for, but a {self.learner_only} run "
                 f"({'sft' if self.sft is not None else 'preference'} set) trains on data.path "
                 "and starts none; leave the generator count out"]
            )  # fmt: skip
        return 0

    @property
    def learner_only(self) -> str | None:
        """What a run whose learner trains on a dataset, with no generator, is: "supervised"
        (`sft`), "preference" (`preference`); None for an RL run."""
        if self.sft is not None:
            return "supervised"
        if self.preference is not None:
            return "preference"
        return None

    @property
    def served_scorers(self) -> list[str]:
        """The names of the scorers the run serves itself (no url), sorted: scorer `index` of
        the placement plan and the supervision policy is this list's."""
        return sorted(name for name, scorer in self.scorers.items() if scorer.served)

    @property
    def user_code(self) -> dict[str, str]:
        """The fields that name a user's code by import path ('package.module:attribute'), by
        dotted name: generator.reward.fn and generator.env.fn unless they are registered names,
        and generator.env.agent. Its modules are imported by the generators' worker processes
        only."""
        fields = {
            "generator.reward.fn": self.generator.reward.fn,
            "generator.env.fn": self.generator.env.fn,
            "generator.env.agent": self.generator.env.agent or "",
        }
        return {name: path for name, path in fields.items() if ":" in path}

    @property
    def run_name(self) -> str:
        """Display name of the run."""
        return self.logging.run_name or self.storage.run_uri.rstrip("/").rsplit("/", 1)[-1]

    def to_yaml(self) -> str:
        """The full, resolved configuration as YAML (loads back to an equal RunConfig)."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)
