"""LoRA adapters: the `model.lora` section and the adapter's names, files and merge.

A LoRA run trains low-rank adapters on a frozen base (Hu et al., 2106.09685): each target linear
layer computes W·x + (α/r)·B·A·x, A `[r, in]`, B `[out, r]`; only A and B learn. PEFT builds the
layers (`peft.inject_adapter_in_model`: the model keeps its own class and layout, each target
becomes a `LoraLayer` holding its original layer as `base_layer`).

Three spellings of one adapter tensor, and the functions that move between them:

    in the learner's model       model.layers.0.self_attn.q_proj.lora_A.default.weight
    PEFT's saved adapter         base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight
                                 (what `adapter_model.safetensors` holds, vLLM loads and the
                                 weight store publishes: `peft_name`)
    the base layer's weight      model.layers.0.self_attn.q_proj.weight  (`base_weight_name`)

`adapter_files` writes a PEFT adapter directory (`adapter_config.json` +
`adapter_model.safetensors`) that `peft.PeftModel.from_pretrained` and vLLM both load;
`merged_weights` folds an adapter into base weights (W + (α/r)·B·A), for export and for
`weights.lora_publish=merged`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, field_validator
from safetensors.torch import save_file
from torch import Tensor

from streamrl.config.base import Section

__all__ = [
    "ADAPTER_NAME",
    "LoraConfig",
    "adapter_files",
    "base_weight_name",
    "inject_adapters",
    "is_adapter_name",
    "merged_weights",
    "peft_name",
    "vllm_max_lora_rank",
    "zero_adapter",
]

ADAPTER_NAME = "default"  # PEFT's name of the one adapter a LoRA run trains
_PEFT_PREFIX = "base_model.model."
_VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM 0.32 sizes its slots for
_NOT_TARGETS = ("lm_head", "embed_tokens")  # tied embeddings: the learner reads them as one


class LoraConfig(Section):
    """Low-rank adapters on a frozen base (`model.lora`; off when unset). The learner trains
    only the adapters (the base stays sharded and frozen), publishes only them, and generators
    load each version in place under one adapter id."""

    rank: int = Field(16, ge=1, le=512, description="r: the adapters' rank.")
    alpha: float = Field(
        32.0, gt=0.0, description="α: the adapters' output is scaled by α / r (PEFT's lora_alpha)."
    )
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Dropout on the adapters' input while training (generators never drop).",
    )
    target_modules: tuple[str, ...] = Field(
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        min_length=1,
        description="Names of the linear layers inside the decoder blocks that get adapters "
        "(PEFT's target_modules; the Llama / Qwen2 names by default).",
    )

    @field_validator("target_modules")
    @classmethod
    def _inside_the_blocks(cls, targets: tuple[str, ...]) -> tuple[str, ...]:
        if found := [t for t in targets if any(part in t for part in _NOT_TARGETS)]:
            raise ValueError(
                f"model.lora.target_modules names {found}: the embeddings and the LM head (tied "
                "in the bundled models) are not LoRA targets; list layers of the decoder blocks "
                "(q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)"
            )
        return targets

    @property
    def scaling(self) -> float:
        """α / r: what B·A·x is multiplied by."""
        return self.alpha / self.rank

    def peft_config(self) -> Any:
        """This adapter as a `peft.LoraConfig` (PEFT's default init: A Kaiming-uniform, B 0)."""
        from peft import LoraConfig as PeftLoraConfig

        return PeftLoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=list(self.target_modules),
            bias="none",
        )

    def adapter_config(self, base_model: str) -> dict[str, Any]:
        """`adapter_config.json` of this adapter on `base_model`: what PEFT saves for it."""
        config = self.peft_config().to_dict()
        config["base_model_name_or_path"] = base_model
        return json.loads(json.dumps(config, default=sorted))  # sets → sorted lists


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM sizes its adapter slots for that holds `rank`."""
    return next(r for r in _VLLM_RANKS if r >= rank)


def is_adapter_name(name: str) -> bool:
    """Whether `name` (the learner's or PEFT's spelling) is a LoRA A or B matrix."""
    return ".lora_A." in name or ".lora_B." in name


def peft_name(name: str) -> str:
    """The learner's name of an adapter tensor → PEFT's saved name (no adapter name, the
    `base_model.model.` prefix)."""
    return _PEFT_PREFIX + name.replace(f".{ADAPTER_NAME}.", ".")


def base_weight_name(name: str) -> str:
    """A parameter name of the LoRA-wrapped model → its name in the base checkpoint
    (`….q_proj.base_layer.weight` → `….q_proj.weight`; other names unchanged)."""
    return name.replace(".base_layer.", ".")


def _module_of(peft: str) -> tuple[str, str]:
    """PEFT's `base_model.model.<module>.lora_A.weight` → (`<module>`, `A` or `B`)."""
    inner = peft.removeprefix(_PEFT_PREFIX)
    for which in ("A", "B"):
        marker = f".lora_{which}.weight"
        if inner.endswith(marker):
            return inner.removesuffix(marker), which
    raise ValueError(f"{peft!r} is not a LoRA A or B weight in PEFT's naming")


def merged_weights(
    base: Mapping[str, Tensor], adapter: Mapping[str, Tensor], lora: LoraConfig
) -> dict[str, Tensor]:
    """`base` (the base checkpoint's tensors, by name) with `adapter` (PEFT names) folded in:
    W ← W + (α/r)·B·A for every adapted layer, computed in float32 and stored in W's dtype.
    Raises `ValueError` when an adapter layer has no base weight or lacks A or B."""
    pairs: dict[str, dict[str, Tensor]] = {}
    for name, value in adapter.items():
        module, which = _module_of(name)
        pairs.setdefault(module, {})[which] = value
    merged = dict(base)
    for module, pair in sorted(pairs.items()):
        weight_name = f"{module}.weight"
        if set(pair) != {"A", "B"} or weight_name not in base:
            raise ValueError(
                f"adapter layer {module}: has {sorted(pair)} of A and B and its base weight "
                f"{'is' if weight_name in base else 'is not'} in the base model; the adapter "
                "does not belong to this base"
            )
        weight = base[weight_name]
        delta = lora.scaling * (pair["B"].float() @ pair["A"].float())
        merged[weight_name] = (weight.float() + delta).to(weight.dtype)
    return merged


def adapter_files(
    folder: str | Path, adapter: Mapping[str, Tensor], lora: LoraConfig, base_model: str
) -> Path:
    """Write `adapter` (PEFT names) as a PEFT adapter directory in `folder` (created):
    `adapter_config.json` and `adapter_model.safetensors`. Returns the folder."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: value.detach().contiguous() for name, value in adapter.items()}
    save_file(tensors, out / "adapter_model.safetensors")
    config = lora.adapter_config(base_model)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out


def inject_adapters(model: torch.nn.Module, lora: LoraConfig) -> torch.nn.Module:
    """Give `model`'s target layers LoRA adapters in place (`peft.inject_adapter_in_model`;
    new adapter tensors on the device of the layer they wrap, meta included) and freeze
    everything but them. Returns `model`."""
    from peft import inject_adapter_in_model

    inject_adapter_in_model(lora.peft_config(), model, adapter_name=ADAPTER_NAME)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_name(name))
    return model


def zero_adapter(model_path: str, lora: LoraConfig, trust_remote_code: bool) -> dict[str, Tensor]:
    """An adapter of zeros for the model at `model_path` (PEFT names, float32): base + it is
    exactly the base model (what generators run before the first version)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    inject_adapters(model, lora)
    return {
        peft_name(name): torch.zeros(param.shape)
        for name, param in model.named_parameters()
        if is_adapter_name(name)
    }
