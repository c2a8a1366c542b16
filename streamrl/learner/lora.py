"""The learner's side of LoRA (`model.lora`): the adapted policy, its reference, what it publishes.

- `lora_policy(meta, lora, seed)`: the policy on the meta device with adapters on its target
  layers (`streamrl.models.lora.inject_adapters`): base weights read from the base checkpoint
  under their own names, A drawn as PEFT draws it (Kaiming-uniform, a = √5) from a generator
  seeded by `seed` and the tensor's name (every rank draws the same, without a broadcast), B
  zero. Only the adapters require grad, so only they reach the optimiser; FSDP2 shards base
  and adapters alike.
- `BaseReference(policy)`: the reference policy of a KL term — the same model with its adapters
  switched off (PEFT's `enable_adapters(False)` on every LoRA layer), so no second model is
  held.
- `publish_shares(lora, mode)`: what a version holds — the adapter alone under PEFT's names, or
  merged weights W + (α/r)·B·A under the base checkpoint's names.
- `CHECKPOINT_OPTIONS` with `is_adapter_name`: a checkpoint holds the adapters and their
  optimiser state, not the frozen base (rebuilt from `model.path`).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from streamrl.learner.publish import Shares, local_shares, tensor_share
from streamrl.models.config import ModelConfig
from streamrl.models.lora import (
    ADAPTER_NAME,
    LoraConfig,
    base_weight_name,
    inject_adapters,
    is_adapter_name,
    peft_name,
)

if TYPE_CHECKING:
    from streamrl.learner.meta import MetaModel

__all__ = [
    "CHECKPOINT_OPTIONS",
    "BaseReference",
    "adapter_manifest",
    "adapters_disabled",
    "initial_adapter",
    "lora_policy",
    "publish_shares",
]

# A checkpoint keeps the adapters (`is_adapter_name`) and their optimiser state; the frozen
# base is never saved (a resume rebuilds it from model.path) and loading leaves it as it is.
CHECKPOINT_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


def initial_adapter(module: nn.Module, seed: int) -> dict[str, Tensor]:
    """Starting values of `module`'s adapter tensors, by name: A Kaiming-uniform (a = √5, as
    PEFT initialises it) from a generator seeded by `seed` and the name, B zero; float32."""
    values = {}
    for name, param in module.named_parameters():
        if not is_adapter_name(name):
            continue
        value = torch.zeros(param.shape, dtype=torch.float32)
        if ".lora_A." in name:
            generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=generator)
        values[name] = value
    return values


def lora_policy(meta: MetaModel, lora: LoraConfig, seed: int) -> MetaModel:
    """`meta` (the base policy on meta) with adapters: base weights read from the base
    checkpoint under their own names, adapters starting at `initial_adapter`."""
    module = inject_adapters(meta.module, lora)
    fresh = initial_adapter(module, seed)

    def load_whole() -> nn.Module:
        whole = inject_adapters(meta.load_whole(), lora)
        with torch.no_grad():
            for name, param in whole.named_parameters():
                if name in fresh:
                    param.copy_(fresh[name])
        return whole

    return replace(
        meta,
        module=module,
        checkpoint_names=lambda name: meta.checkpoint_names(base_weight_name(name)),
        load_whole=load_whole,
        fresh={**meta.fresh, **fresh},
    )


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within it, `model`'s LoRA layers compute their base layer alone."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


class BaseReference:
    """The reference policy of a LoRA run: the policy with its adapters switched off, called as
    the policy is (`forward.token_scores` reads it like a model)."""

    def __init__(self, policy: nn.Module) -> None:
        self.policy = policy

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with adapters_disabled(self.policy):
            return self.policy(*args, **kwargs)

    def get_output_embeddings(self) -> nn.Module:
        return self.policy.get_output_embeddings()


def adapter_manifest(model: ModelConfig, mode: str) -> dict[str, Any] | None:
    """What a version's manifest records of an adapter (`model_config`): the base model it
    belongs to and its PEFT `adapter_config.json`; None when versions are whole models."""
    if model.lora is None or mode != "adapter":
        return None
    return {"lora_base_model": model.path, "lora_adapter": model.lora.adapter_config(model.path)}


def publish_shares(lora: LoraConfig | None, mode: str) -> Callable[[nn.Module, bool], Shares]:
    """What each rank publishes of the policy: every tensor (no LoRA), the adapter alone under
    PEFT's names (`adapter`), or merged weights under the base checkpoint's names (`merged`)."""
    if lora is None:
        return local_shares
    if mode == "adapter":
        return _adapter_shares
    return lambda model, is_main: _merged_shares(model, is_main, lora)


def _adapter_shares(model: nn.Module, is_main: bool) -> Shares:
    # A tied embedding's second name survives `ignore_frozen_params`: keep adapters by name.
    state = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
    return {
        peft_name(name): tensor_share(value, is_main)
        for name, value in state.items()
        if is_adapter_name(name)
    }


def _merged_shares(model: nn.Module, is_main: bool, lora: LoraConfig) -> Shares:
    """W + (α/r)·B·A for each adapted layer, this rank's rows of it: W and B are sharded alike
    on dim 0 (the layer's outputs); A (`[r, in]`, small) is gathered whole on every rank, in
    the same order everywhere (a collective)."""
    state = get_model_state_dict(model)
    shares: Shares = {}
    for name, value in state.items():
        if is_adapter_name(name):
            continue
        if ".base_layer." not in name or not name.endswith(".weight"):
            shares[base_weight_name(name)] = tensor_share(value, is_main)
            continue
        module = name.removesuffix(".base_layer.weight")
        a, b = (state[f"{module}.lora_{which}.{ADAPTER_NAME}.weight"] for which in ("A", "B"))
        whole_a = a.full_tensor() if isinstance(a, DTensor) else a
        local_b = b.to_local() if isinstance(b, DTensor) else b
        local, start, shape = tensor_share(value, is_main)
        merged = local.float() + lora.scaling * (local_b.float() @ whole_a.float())
        shares[base_weight_name(name)] = (merged.to(local.dtype), start, shape)
    return shares
