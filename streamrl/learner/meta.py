"""The learner's models on the meta device, and the sharded reads that fill them.

`meta_policy` / `meta_value_model` construct a model with its parameters on the meta device
(`parameters_on_meta`: no memory; buffers such as the rotary `inv_freq` are computed on CPU as
in any construction) and say where each parameter's values are (`MetaModel`). Once sharded,
`load_sharded` allocates it on the learner's device and fills it from the checkpoint's
safetensors files: each rank reads only its own dim-0 rows of each parameter (FSDP2 shards dim
0), so no rank ever holds a whole model.

Checkpoint names: the policy's parameters are named as in its checkpoint. The critic's
backbone (`backbone.X`) is read from `<prefix>.X` of a causal-LM or sequence-classification
checkpoint (`prefix` is HF's `base_model_prefix`, `model` for Qwen2/Llama) or from `X` of a
bare backbone; a reward model's scalar head from its own name (`score.weight`); a fresh head is
drawn on CPU as `load_value_model` draws it. A tied parameter is read under whichever of its
names the checkpoint has (a tied `lm_head.weight` is usually not saved).

A checkpoint without safetensors files (only `pytorch_model.bin`), or lacking a parameter under
every name tried, is loaded whole on every rank before sharding, with a log line.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
)

from streamrl.algorithms.value_heads import ScalarHead, ScalarValueHead, ValueHead
from streamrl.learner.model import (
    ValueModel,
    critic_init,
    load_policy,
    load_value_model,
    reward_model_config,
    reward_model_head,
)
from streamrl.learner.topology import Topology
from streamrl.models import resolve_model_path
from streamrl.models.config import ModelConfig

__all__ = [
    "MetaModel",
    "SafetensorsCheckpoint",
    "Shard",
    "load_sharded",
    "meta_policy",
    "meta_value_model",
    "parameters_on_meta",
]

log = logging.getLogger(__name__)

Shard = Callable[[nn.Module], nn.Module]


# -- models on the meta device --------------------------------------------------------------


@dataclass(frozen=True)
class MetaModel:
    """A model constructed with its parameters on the meta device, and where their values are.

    `module`: parameters on meta, buffers real (on CPU); its HF parts in eval mode, as
    `from_pretrained` leaves them. `checkpoint`: the directory its weights are read from.
    `checkpoint_names(name)`: the checkpoint tensor names that may hold the parameter or
    buffer `name` of `module`, most likely first. `fresh`: whole CPU values of parameters that
    are not read (a newly drawn head), by name. `load_whole()`: the same model loaded whole
    on CPU, for checkpoints that cannot be read in slices."""

    module: nn.Module
    checkpoint: Path
    checkpoint_names: Callable[[str], tuple[str, ...]]
    load_whole: Callable[[], nn.Module]
    fresh: dict[str, Tensor] = field(default_factory=dict)


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within it, every parameter a module registers is moved to the meta device (its storage
    freed before any initialiser touches it); buffers stay where they are built, so values
    computed at construction (the rotary `inv_freq`) are real. Not thread-safe: it patches
    `nn.Module.register_parameter` for its duration."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        # A parameter already on meta is registered as itself: tying two modules' weights
        # must keep them one object.
        if param is not None and param.device.type != "meta":
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def meta_policy(
    model_path: str, model_cfg: ModelConfig, dtype: torch.dtype = torch.float32
) -> MetaModel:
    """The causal LM at `model_path` on meta, with `dtype` parameters (`load_policy`'s model)."""
    path = resolve_model_path(model_path)
    trust = model_cfg.trust_remote_code
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust)
    model.config.use_cache = False
    return MetaModel(
        model.eval(),
        Path(path),
        lambda name: (name,),
        lambda: load_policy(model_path, model_cfg, dtype),
    )


def meta_value_model(
    model_path: str,
    model_cfg: ModelConfig,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    head: ValueHead | None = None,
) -> MetaModel:
    """The critic `load_value_model` builds, on meta: from the policy's checkpoint with a fresh
    value head `head` (`algorithm.value_head`, default scalar; drawn from `seed`), or from a
    reward model's backbone and scalar head."""
    head_cfg = ScalarHead() if head is None else head
    init_from, trust = critic_init(model_cfg, head_cfg), model_cfg.trust_remote_code
    head_names: dict[str, tuple[str, ...]] = {}
    fresh: dict[str, Tensor] = {}
    value_head: nn.Module
    if init_from == "policy":
        path = resolve_model_path(model_path)
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
        with parameters_on_meta():
            backbone = AutoModel.from_config(config, dtype=dtype, trust_remote_code=trust)
        backbone.eval()
        value_head = head_cfg.build(config.hidden_size, dtype, seed)
        fresh = {
            f"value_head.{name}": value.detach().clone()
            for name, value in value_head.named_parameters()
        }
        value_head = value_head.to("meta")
    else:
        path = resolve_model_path(init_from)
        config = reward_model_config(init_from, model_path, trust)
        with parameters_on_meta():
            reward_model = AutoModelForSequenceClassification.from_config(
                config, dtype=dtype, trust_remote_code=trust
            )
        backbone = reward_model.eval().base_model
        source_name, source = reward_model_head(reward_model, init_from)
        value_head = ScalarValueHead(source.in_features, device="meta", dtype=dtype)
        head_names["value_head.weight"] = (f"{source_name}.weight",)
        if source.bias is not None:
            head_names["value_head.bias"] = (f"{source_name}.bias",)
        else:
            fresh["value_head.bias"] = torch.zeros(1, dtype=dtype)
    backbone.config.use_cache = False
    prefix = backbone.base_model_prefix

    def checkpoint_names(name: str) -> tuple[str, ...]:
        if name.startswith("backbone."):
            inner = name.removeprefix("backbone.")
            return (f"{prefix}.{inner}", inner)
        return head_names.get(name, ())

    return MetaModel(
        ValueModel(backbone, value_head),
        Path(path),
        checkpoint_names,
        lambda: load_value_model(model_path, model_cfg, dtype, seed, head_cfg),
        fresh,
    )


# -- sharded reads --------------------------------------------------------------------------


class SafetensorsCheckpoint:
    """The tensors of a checkpoint directory's safetensors files: `model.safetensors`, or the
    files `model.safetensors.index.json` lists (its `weight_map`: tensor name → file name).
    Each file is opened once, on its first read, and closed with the checkpoint; a read of
    some rows copies only those rows out of the file."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files  # tensor name → the file holding it
        self._handles: dict[Path, Any] = {}
        self._stack = ExitStack()

    @classmethod
    def find(cls, directory: Path) -> SafetensorsCheckpoint | None:
        """The safetensors checkpoint in `directory`, or None when it has none."""
        single = directory / "model.safetensors"
        if single.is_file():
            with safe_open(single, framework="pt") as handle:
                return cls(dict.fromkeys(handle.keys(), single))
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return cls({name: directory / file for name, file in weight_map.items()})
        return None

    def _handle(self, name: str) -> Any:
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(
                safe_open(path, framework="pt", device="cpu")
            )
        return self._handles[path]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, rows: slice | None = None) -> Tensor:
        """Tensor `name` whole, or only its dim-0 `rows` (a slice with start and stop)."""
        if rows is None:
            return self._handle(name).get_tensor(name)
        return self._handle(name).get_slice(name)[rows]

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


Source = str | Tensor  # a checkpoint tensor name, or the whole value


def load_sharded(meta: MetaModel, shard: Shard, topology: Topology) -> nn.Module:
    """`meta`'s model, sharded by `shard` (which must work on meta, as `shard_model` does), on
    `topology.device`, each rank having read only its own shards. Falls back to
    `shard(meta.load_whole())`, with a log line, where the checkpoint has no safetensors files
    or lacks a parameter."""
    checkpoint = SafetensorsCheckpoint.find(meta.checkpoint)
    sources, missing = _plan_reads(meta, set(checkpoint.files)) if checkpoint else ({}, [])
    if checkpoint is None or missing:
        reason = (
            "has no safetensors files (pytorch_model.bin only?)"
            if checkpoint is None
            else f"lacks {len(missing)} of the model's parameters ({', '.join(missing[:3])}, …)"
        )
        topology.main_only(lambda: log.warning(
            "checkpoint %s %s: every rank loads the whole model before sharding",
            meta.checkpoint, reason,
        ))  # fmt: skip
        return shard(meta.load_whole())
    model = shard(meta.module)
    # `to_empty` allocates buffers too, uninitialised: keep the values built with the model.
    built_buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    model.to_empty(device=topology.device)
    with checkpoint, torch.no_grad():
        for name, param in model.named_parameters():
            _fill(param, sources[_unwrapped(name)], checkpoint, name)
        for name, buffer in model.named_buffers():
            source = sources.get(_unwrapped(name), built_buffers[name])
            _fill(buffer, source, checkpoint, name)
    return model


def _unwrapped(name: str) -> str:
    """`name` without activation checkpointing's wrapper prefix: the name before sharding."""
    return name.replace(_CHECKPOINT_PREFIX, "")


def _plan_reads(meta: MetaModel, available: set[str]) -> tuple[dict[str, Source], list[str]]:
    """Where each parameter of `meta.module` (under every name of a tied one) and each saved
    buffer found in the checkpoint comes from; and the parameters found nowhere."""
    module = meta.module
    names_of: dict[int, list[str]] = defaultdict(list)
    for name, param in module.named_parameters(remove_duplicate=False):
        names_of[id(param)].append(name)
    sources: dict[str, Source] = {}
    missing = []
    for names in names_of.values():
        source: Source | None = next((meta.fresh[n] for n in names if n in meta.fresh), None)
        if source is None:
            candidates = (c for n in names for c in meta.checkpoint_names(n) if c in available)
            source = next(candidates, None)
        if source is None:
            missing.append(names[0])
        else:
            sources.update(dict.fromkeys(names, source))
    saved = module.state_dict().keys()
    for name, _ in module.named_buffers(remove_duplicate=False):
        found = [c for c in meta.checkpoint_names(name) if c in available]
        if name in saved and found:  # a buffer not saved keeps its constructed value
            sources[name] = found[0]
    return sources, missing


def _fill(target: Tensor, source: Source, checkpoint: SafetensorsCheckpoint, name: str) -> None:
    """Write this rank's part of `target` from `source`: its own dim-0 rows of a DTensor
    sharded on dim 0 (FSDP2's `Shard(0)`), all of any other tensor; cast to `target`'s dtype."""
    shape = tuple(source.shape) if isinstance(source, Tensor) else checkpoint.shape(source)
    if shape != tuple(target.shape):
        raise ValueError(
            f"{name}: the checkpoint's tensor has shape {list(shape)} but the model's has "
            f"{list(target.shape)}; the checkpoint does not match its config.json"
        )
    rows = None
    local = target
    if isinstance(target, DTensor):
        local = target.to_local()
        local_shape, offset = compute_local_shape_and_global_offset(
            target.shape, target.device_mesh, target.placements
        )
        if tuple(local_shape) != (*local.shape,) or tuple(local_shape[1:]) != target.shape[1:]:
            raise ValueError(
                f"{name} is sharded as {target.placements} (local shape {list(local.shape)}); "
                "sharded reads expect dim 0 split over ranks, as shard_model does"
            )
        rows = slice(offset[0], offset[0] + local_shape[0])
        if local.numel() == 0:  # more ranks than rows: nothing here
            return
    if isinstance(source, Tensor):
        values = source if rows is None else source[rows]
    else:
        values = checkpoint.read(source, rows)
    local.copy_(values.to(local.dtype))
