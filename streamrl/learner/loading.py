"""Building the learner's models: on the meta device, sharded, then filled by sharded reads.

`build_step_models(config, topology)` makes the policy, and the reference and critic the
algorithm needs, with their optimisers. Each model is constructed with its parameters on the
meta device, given the learner's output layer where it scores tokens
(`use_hidden_states_head`), sharded by `shard_model`, allocated on the learner's device, and
filled from the checkpoint's safetensors files, each rank reading only its own shard
(`streamrl.learner.meta`). The result is bitwise the model `load_policy` / `load_value_model`
then `shard_model` give.

Dtypes: policy and critic keep float32 master weights. A frozen reference is only read, in the
compute dtype, so it is stored in it (`shard_model` then all-gathers it without a cast, at half
the memory under bf16); an EMA reference is updated toward the policy and stays float32.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from streamrl.config.run import RunConfig
from streamrl.learner.forward import (
    attention_implementation,
    set_attention,
    shares_prompts,
    use_hidden_states_head,
)
from streamrl.learner.lora import BaseReference, lora_policy
from streamrl.learner.meta import load_sharded, meta_policy, meta_value_model
from streamrl.learner.model import (
    compute_dtype,
    shard_model,
)
from streamrl.learner.optim import build_optimizer, build_scheduler
from streamrl.learner.step_inputs import StepModels, Trainable, ValuePrior
from streamrl.learner.topology import Topology

__all__ = ["build_step_models"]

log = logging.getLogger(__name__)


def build_step_models(config: RunConfig, topology: Topology) -> tuple[StepModels, bool]:
    """Policy, and the critic / reference the algorithm needs (a supervised run: the policy
    alone), sharded over the topology, with their optimisers and schedules; and whether each
    group's prompt is computed once (`learner.shared_prompt` resolved for the policy's
    attention)."""
    cfg, algorithm, model_cfg = config.learner, config.algorithm, config.model
    torch.manual_seed(cfg.seed)
    attention = attention_implementation(cfg.attention, topology.device)

    def shard(model: nn.Module) -> nn.Module:
        set_attention(model, attention)
        return shard_model(model, topology, cfg.mixed_precision, cfg.activation_checkpointing)

    def shard_lm(model: nn.Module) -> nn.Module:
        return shard(use_hidden_states_head(model))

    def trainable(model: nn.Module, lr: float, updates: int) -> Trainable:
        optimizer = build_optimizer(model.parameters(), lr, cfg.weight_decay, cfg.betas, cfg.eps)
        schedule = build_scheduler(
            optimizer, cfg.warmup_steps, updates, cfg.schedule, cfg.min_lr_ratio
        )
        return Trainable(model, optimizer, schedule)

    updates = cfg.total_steps * cfg.updates_per_batch  # schedules count optimiser updates
    meta = meta_policy(model_cfg.path, model_cfg)
    if model_cfg.lora is not None:  # adapters on the frozen base: only they learn
        meta = lora_policy(meta, model_cfg.lora, cfg.seed)
    policy = load_sharded(meta, shard_lm, topology)
    shared_prompt = shares_prompts(policy, cfg.shared_prompt)
    topology.main_only(lambda: log.info(
        "each group's prompt computed %s (learner.shared_prompt=%s, %s attention); LM head "
        "on response positions only", "once" if shared_prompt else "per response",
        cfg.shared_prompt, attention,
    ))  # fmt: skip
    models = StepModels(trainable(policy, cfg.lr, updates))

    def reference(ema: bool) -> nn.Module:
        if model_cfg.lora is not None:  # the base: the adapters switched off
            return BaseReference(policy)
        # A frozen reference is only ever all-gathered in the compute dtype; an EMA one is
        # updated toward the fp32 policy, so it keeps fp32.
        dtype = torch.float32 if ema else compute_dtype(cfg.mixed_precision, topology.device)
        frozen = load_sharded(meta_policy(model_cfg.path, model_cfg, dtype), shard_lm, topology)
        return frozen.requires_grad_(False).eval()

    if config.learner_only:  # supervised: the policy alone; preference: and its reference
        if config.preference is not None and config.preference.needs_reference:
            models.reference = reference(ema=False)
        return models, shared_prompt
    kl = algorithm.reference_kl
    if kl is not None:
        models.reference = reference(ema=kl.reference == "ema")
    if algorithm.uses_value_model:

        def critic() -> nn.Module:
            meta = meta_value_model(
                model_cfg.path, model_cfg, seed=cfg.seed, head=algorithm.value_head
            )
            return load_sharded(meta, shard, topology)

        critic_updates = updates + algorithm.value_pretrain_steps * cfg.updates_per_batch
        models.critic = trainable(critic(), cfg.critic_lr, critic_updates)
        if algorithm.critic_prior is not None:  # V_pre: frozen, sharded like the critic
            models.value_prior = ValuePrior(critic().requires_grad_(False).eval())
    return models, shared_prompt
