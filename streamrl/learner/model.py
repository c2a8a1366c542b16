"""The learner's models and their FSDP2 sharding.

- `load_policy`: the Hugging Face causal LM being trained, fp32 master weights, loaded whole.
  The learner itself builds its models on the meta device and reads only its shards
  (`streamrl.learner.loading`); these loaders are its fallback and what it is tested against.
- `ValueModel` / `load_value_model` (VAPO, PPO): the policy's backbone (`AutoModel` of the
  same architecture) with a value head (`algorithm.value_head`: scalar, multi-head or
  distributional, `streamrl.algorithms.value_heads`), initialised from the policy or, with the
  scalar head, from a reward model.
- `shard_model`: the one place models are wrapped: `fully_shard` each decoder layer, then the
  root (embeddings, final norm, LM or value head). Gradients are *summed* over ranks, not
  averaged: losses divide by global token counts (the whole mini-batch on all ranks), so the
  sum over ranks is the full-batch gradient.
- `full_state_dict`: the unsharded weights on rank 0, named as in the HF checkpoint, for the
  weight store (and so for vLLM).

Decoder layers are found at `<base model>.layers`, where the base model is HF's `base_model`
(`model.model` of a `*ForCausalLM`, the model itself for an `AutoModel`): the Llama / Qwen2 /
Mistral / SmolLM layout. Other layouts fail in `decoder_layers` with a message saying so.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PretrainedConfig,
    PreTrainedModel,
)

from streamrl.algorithms.value_heads import ScalarHead, ScalarValueHead, ValueHead
from streamrl.learner.topology import Topology
from streamrl.models import resolve_model_path
from streamrl.models.config import ModelConfig

__all__ = [
    "ValueModel",
    "compute_dtype",
    "critic_init",
    "decoder_layers",
    "full_state_dict",
    "load_policy",
    "load_value_model",
    "reward_model_config",
    "reward_model_head",
    "shard_model",
]


def load_policy(
    model_path: str, model_cfg: ModelConfig, dtype: torch.dtype = torch.float32
) -> PreTrainedModel:
    """The causal LM at `model_path` (a directory or a bundled name such as `tiny-qwen2`), on
    CPU with `dtype` parameters: keep float32 master weights and let `shard_model` choose the
    compute dtype. The KV cache is off (`config.use_cache = False`): the learner never decodes.
    The whole model is loaded: sharded, each rank would first need the CPU memory for all of
    it (`streamrl.learner.meta.meta_policy` avoids that)."""
    path = resolve_model_path(model_path)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, trust_remote_code=model_cfg.trust_remote_code
    )
    model.config.use_cache = False
    return model


class ValueModel(nn.Module):
    """V(s_t) for every token position: a transformer backbone and a value head
    (`streamrl.algorithms.value_heads`: its forward maps hidden states `[B, T, H]` to outputs
    `[B, T, K]` float32, its `value` reads V from them).

    `forward(input_ids [B, T], attention_mask [B, T] | None, position_ids [B, T] | None)`
    returns values [B, T] float32, where values[b, t] estimates the return after token t; with
    `outputs=True` the head's outputs `[B, T, K]` instead (what the critic's loss reads), of
    which `value` gives the values."""

    def __init__(self, backbone: PreTrainedModel, value_head: nn.Module) -> None:
        super().__init__()
        if value_head.in_features != backbone.config.hidden_size:
            raise ValueError(
                f"value_head must read hidden_size={backbone.config.hidden_size}, got "
                f"{value_head.in_features}"
            )
        self.backbone = backbone
        self.value_head = value_head

    @property
    def base_model(self) -> nn.Module:
        """The transformer holding the decoder layers (found by `decoder_layers`)."""
        return self.backbone.base_model

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        *,
        outputs: bool = False,
    ) -> Tensor:
        hidden = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        ).last_hidden_state  # [B, T, H]
        head_outputs = self.value_head(hidden)  # [B, T, K] float32
        result = head_outputs if outputs else self.value(head_outputs)
        # A tensor of its own, not a view (a linear layer's output on [B, T, H] is one): FSDP2
        # hooks the root's output for its backward, which a view would not keep safely (it warns).
        return result.clone()

    def value(self, outputs: Tensor) -> Tensor:
        """V from the head's outputs: `[..., K]` → `[...]` float32 (no parameters read)."""
        return self.value_head.value(outputs)


def load_value_model(
    model_path: str,
    model_cfg: ModelConfig,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    head: ValueHead | None = None,
) -> ValueModel:
    """The critic as `model_cfg.critic.init_from` says, with the value head `head`
    (`algorithm.value_head`; default scalar).

    - `policy`: the backbone of the policy at `model_path`; a fresh head (`head.build`: each
      weight drawn from N(0, (1/(H+1))²) by a generator seeded with `seed`, so every rank draws
      the same head without a broadcast).
    - a path: a reward model saved as `*ForSequenceClassification` with one label, over the
      policy's vocabulary; its backbone and its scalar head (`score`) are both used. Only the
      scalar head starts from one (`reward_model_refusal` says why the others do not).
    """
    head = ScalarHead() if head is None else head
    init_from = critic_init(model_cfg, head)
    trust = model_cfg.trust_remote_code
    if init_from == "policy":
        backbone = AutoModel.from_pretrained(
            resolve_model_path(model_path), dtype=dtype, trust_remote_code=trust
        )
        value_head = head.build(backbone.config.hidden_size, dtype, seed)
    else:
        backbone, value_head = _reward_model_parts(init_from, model_path, trust, dtype)
    backbone.config.use_cache = False
    return ValueModel(backbone, value_head)


def critic_init(model_cfg: ModelConfig, head: ValueHead) -> str:
    """`model.critic.init_from`, checked to be set and to suit the value head `head`."""
    if model_cfg.critic is None:
        raise ValueError("model.critic is not set; set model.critic.init_from=policy")
    init_from = model_cfg.critic.init_from
    if init_from != "policy" and (problem := head.reward_model_refusal(init_from)):
        raise ValueError(problem)
    return init_from


def reward_model_config(path: str, policy_path: str, trust_remote_code: bool) -> PretrainedConfig:
    """The config of the reward model at `path` (a directory or bundled name), checked to be a
    one-label `*ForSequenceClassification` over the vocabulary of the policy at `policy_path`
    (`model.critic.init_from` otherwise fails here, naming the fix)."""
    config = AutoConfig.from_pretrained(
        resolve_model_path(path), trust_remote_code=trust_remote_code
    )
    policy_config = AutoConfig.from_pretrained(
        resolve_model_path(policy_path), trust_remote_code=trust_remote_code
    )
    architectures = config.architectures or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures) or (
        config.num_labels != 1
    ):
        raise ValueError(
            f"model.critic.init_from={path!r} is not a one-label reward model (architectures "
            f"{architectures}, num_labels {config.num_labels}); give a *ForSequenceClassification "
            "checkpoint with num_labels=1, or set model.critic.init_from=policy"
        )
    if config.vocab_size != policy_config.vocab_size:
        raise ValueError(
            f"model.critic.init_from={path!r} has vocab_size {config.vocab_size} but the policy "
            f"has {policy_config.vocab_size}; the critic must share the policy's tokenizer"
        )
    return config


def reward_model_head(reward_model: PreTrainedModel, path: str) -> tuple[str, nn.Linear]:
    """The scalar head beside the backbone of the reward model loaded from `path`, and its
    name (`score` for HF's `*ForSequenceClassification`)."""
    heads = [
        (name, module)
        for name, module in reward_model.named_children()
        if name != reward_model.base_model_prefix and isinstance(module, nn.Linear)
    ]
    if len(heads) != 1 or heads[0][1].out_features != 1:
        raise ValueError(
            f"model.critic.init_from={path!r}: expected one scalar Linear head beside the "
            f"backbone, found {[type(h).__name__ for _, h in heads]}; use init_from=policy"
        )
    return heads[0]


def _reward_model_parts(
    path: str, policy_path: str, trust_remote_code: bool, dtype: torch.dtype
) -> tuple[PreTrainedModel, ScalarValueHead]:
    reward_model_config(path, policy_path, trust_remote_code)
    reward_model = AutoModelForSequenceClassification.from_pretrained(
        resolve_model_path(path), dtype=dtype, trust_remote_code=trust_remote_code
    )
    backbone = reward_model.base_model
    _, source = reward_model_head(reward_model, path)
    head = ScalarValueHead(source.in_features, device="meta", dtype=dtype).to_empty(device="cpu")
    with torch.no_grad():
        head.weight.copy_(source.weight)
        head.bias.copy_(source.bias if source.bias is not None else torch.zeros(1))
    return backbone, head


# -- FSDP2 ---------------------------------------------------------------------------------


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of a causal LM or `ValueModel`: `model.base_model.layers`."""
    base = getattr(model, "base_model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"{type(model).__name__} has no decoder layers at `.model.layers` (the Llama/Qwen2 "
            "layout streamrl's FSDP wrapping expects); use a model of that family, or extend "
            "streamrl.learner.model.decoder_layers for this architecture"
        )
    return layers


def compute_dtype(
    mixed_precision: Literal["auto", "bf16", "fp32"], device: torch.device
) -> torch.dtype:
    """`learner.mixed_precision` → the dtype forward and backward run in (auto: bf16 on CUDA,
    fp32 on CPU)."""
    if mixed_precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if mixed_precision not in ("bf16", "fp32"):
        raise ValueError(
            f"learner.mixed_precision must be auto, bf16 or fp32, not {mixed_precision!r}"
        )
    return torch.bfloat16 if mixed_precision == "bf16" else torch.float32


def shard_model(
    model: nn.Module,
    topology: Topology,
    mixed_precision: Literal["auto", "bf16", "fp32"] = "auto",
    activation_checkpointing: bool = False,
) -> nn.Module:
    """Shard `model` in place over `topology.mesh` with FSDP2 and return it.

    Units: each decoder layer (optionally wrapped for activation checkpointing first), then
    the root, which takes everything else. Tied input/output embeddings (`lm_head.weight is
    embed_tokens.weight`) are one parameter and both modules sit in the root unit, so the tie
    survives sharding. Parameters keep their dtype (fp32 master weights); in bf16 they are
    all-gathered and used in bf16 while gradients are reduced in fp32. Gradients are summed
    over ranks (divide factor 1): each rank's loss must use the global denominator. Parameters
    on the meta device stay there, sharded (`streamrl.learner.loading` allocates and fills them).
    """
    dtype = compute_dtype(mixed_precision, topology.device)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    layers = decoder_layers(model)
    for index, layer in enumerate(layers):
        if activation_checkpointing:
            # Recompute the block's activations in backward; state-dict names stay unchanged
            # (DCP's state_dict strips the wrapper's `_checkpoint_wrapped_module.` prefix).
            layer = checkpoint_wrapper(layer)
            layers[index] = layer
        fully_shard(layer, mesh=topology.mesh, mp_policy=policy)
    # The root keeps its parameters gathered from forward to backward: the output layer's
    # weight is read after the forward (`streamrl.learner.forward.token_scores`).
    fully_shard(model, mesh=topology.mesh, mp_policy=policy, reshard_after_forward=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    return model


def full_state_dict(model: nn.Module, topology: Topology) -> dict[str, Tensor] | None:
    """The unsharded state dict on CPU on the main rank, None on the others (a collective:
    call it on every rank). Names are the HF checkpoint's (`model.layers.0.mlp.up_proj.weight`);
    a tied model carries both `model.embed_tokens.weight` and `lm_head.weight`, as
    `model.state_dict()` does, so `load_state_dict(strict=True)` accepts it."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    return state if topology.is_main else None
