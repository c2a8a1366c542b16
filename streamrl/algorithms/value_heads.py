"""The critic's value head, an option of the value-model algorithms (`algorithm.value_head`).

* `scalar` (default; VAPO, PPO): V(s) = w·h + b on the backbone's last hidden state h.
* `multi_head` (the framework guide's eq 21): H scalar heads V_h(s) = w_h·h + b_h and a linear
  gate g(s): V(s) = Σ_h softmax(g(s))_h · V_h(s). Trained by the clipped value loss on V.
* `distributional` (eq 22): logits over N atoms z_1..z_N evenly spaced on [v_min, v_max],
  p = softmax, V = Σ_i p_i·z_i (what GAE and explained variance read). Trained by the
  cross-entropy against the two-hot projection of the value target clipped to [v_min, v_max]
  (`streamrl.algorithms.losses.distributional_value_loss`); ε_v (`value_clip`) does not apply.

Each kind is one config class that builds its head (`build`: drawn on CPU by a generator seeded
with the learner's seed, so every rank draws the same head without a broadcast) and computes
its loss (`loss`). A head maps hidden states `[B, T, H]` to its outputs `[B, T, K]` float32
(K = 1, V itself, for scalar and multi-head; K = N logits for distributional), and `value`
reads V `[B, T]` from them. The scalar head is `nn.Linear(H, 1)` itself: its parameters keep
the names `value_head.weight` / `value_head.bias` and its draw, so critics and checkpoints made
before head kinds existed load and resume unchanged.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

import torch
from pydantic import Field, Tag, model_validator
from torch import Tensor, nn

from streamrl.algorithms.losses import (
    Metrics,
    distributional_value,
    distributional_value_loss,
    value_loss,
)
from streamrl.config.base import Section, tag_or, tagged_classes

__all__ = [
    "VALUE_HEAD_CLASSES",
    "DistributionalHead",
    "DistributionalValueHead",
    "MultiHead",
    "MultiValueHead",
    "ScalarHead",
    "ScalarValueHead",
    "ValueHead",
]


# -- the heads ------------------------------------------------------------------------------


class ScalarValueHead(nn.Linear):
    """V = w·h + b: `forward(hidden [B, T, H])` → `[B, T, 1]` float32."""

    def __init__(
        self,
        hidden_size: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(hidden_size, 1, device=device, dtype=dtype)

    def forward(self, hidden: Tensor) -> Tensor:
        return super().forward(hidden).float()

    def value(self, outputs: Tensor) -> Tensor:
        """V from the outputs: `[..., 1]` → `[...]`."""
        return outputs[..., 0]


class MultiValueHead(nn.Module):
    """V = Σ_h softmax(g)_h · V_h with `heads` scalar heads (`heads`, one row each) and a
    linear gate (`gate`): `forward(hidden [B, T, H])` → V `[B, T, 1]` float32."""

    def __init__(
        self,
        hidden_size: int,
        heads: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features = hidden_size
        self.heads = nn.Linear(hidden_size, heads, device=device, dtype=dtype)
        self.gate = nn.Linear(hidden_size, heads, device=device, dtype=dtype)

    def forward(self, hidden: Tensor) -> Tensor:
        per_head = self.heads(hidden).float()  # [B, T, heads]
        weights = torch.softmax(self.gate(hidden).float(), dim=-1)
        return (weights * per_head).sum(-1, keepdim=True)

    def value(self, outputs: Tensor) -> Tensor:
        """V from the outputs: `[..., 1]` → `[...]`."""
        return outputs[..., 0]


class DistributionalValueHead(nn.Linear):
    """Logits over `atoms` atoms evenly spaced on [v_min, v_max]: `forward(hidden [B, T, H])`
    → `[B, T, atoms]` float32; `value` gives V = Σ softmax(logits)·z."""

    def __init__(
        self,
        hidden_size: int,
        atoms: int,
        v_min: float,
        v_max: float,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(hidden_size, atoms, device=device, dtype=dtype)
        self.v_min, self.v_max = v_min, v_max

    def forward(self, hidden: Tensor) -> Tensor:
        return super().forward(hidden).float()

    def value(self, outputs: Tensor) -> Tensor:
        """V from the logits: `[..., atoms]` → `[...]`."""
        return distributional_value(outputs, self.v_min, self.v_max)


Head = TypeVar("Head", bound=nn.Module)


def _drawn(head: Head, seed: int, *, zero: tuple[str, ...] = ()) -> Head:
    """`head` (on meta) allocated on CPU, each weight drawn from N(0, (1/(H+1))²) in parameter
    order by a generator seeded with `seed`; biases, and the parameters whose names start with
    a prefix in `zero`, 0."""
    head = head.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.endswith("bias") or name.startswith(zero):
                param.zero_()
            else:
                param.normal_(0.0, 1.0 / (param.shape[-1] + 1), generator=generator)
    return head


# -- their configuration --------------------------------------------------------------------


class ValueHeadKind(Section):
    """What a value-head kind gives the critic: its head, its loss, and whether it may start
    from a reward model."""

    def build(self, hidden_size: int, dtype: torch.dtype, seed: int) -> nn.Module:
        """A fresh head on CPU for a backbone of `hidden_size`, with `dtype` parameters, drawn
        from `seed` (the same on every rank)."""
        raise NotImplementedError

    def loss(
        self,
        outputs: Tensor,
        values: Tensor,
        old_values: Tensor,
        targets: Tensor,
        mask: Tensor,
        *,
        clip: float,
        num_tokens: int,
    ) -> tuple[Tensor, Metrics]:
        """The critic's loss on one micro-batch, token-mean over `num_tokens` (the mini-batch's
        loss tokens on all ranks): `outputs [N, T, K]` the head's, `values [N, T]` V from them
        (both with grad), `old_values, targets, mask: [N, T]`. Default: the clipped value loss
        on V (ε_v = `clip`)."""
        return value_loss(values, old_values, targets, mask, clip=clip, num_tokens=num_tokens)

    def reward_model_refusal(self, init_from: str) -> str | None:
        """Why a critic with this head cannot start from the reward model at `init_from`
        (`model.critic.init_from`), or None when it can."""
        kind = self.model_dump()["kind"]
        return (
            f"model.critic.init_from={init_from!r} starts the critic from a reward model's "
            f"scalar head, but algorithm.value_head.kind={kind} needs a head of its own; set "
            "model.critic.init_from=policy, or algorithm.value_head.kind=scalar"
        )

    @property
    def layout(self) -> dict[str, object] | None:
        """What a critic checkpoint must have been written with to resume under this head:
        None for the scalar head (as checkpoints written before head kinds), else the head's
        settings (its shapes, and what its outputs mean)."""
        return self.model_dump()


class ScalarHead(ValueHeadKind):
    """The papers' scalar head (VAPO, PPO)."""

    kind: Literal["scalar"] = Field("scalar", description="scalar: V = w·h + b.")

    def build(self, hidden_size: int, dtype: torch.dtype, seed: int) -> ScalarValueHead:
        return _drawn(ScalarValueHead(hidden_size, device="meta", dtype=dtype), seed)

    def reward_model_refusal(self, init_from: str) -> str | None:
        return None

    @property
    def layout(self) -> dict[str, object] | None:
        return None


class MultiHead(ValueHeadKind):
    """The guide's multi-head value (eq 21): V = Σ_h softmax(g)_h·V_h. The gate starts at 0
    (V starts as the heads' mean); each head is drawn as the scalar head is."""

    kind: Literal["multi_head"] = Field(
        "multi_head", description="multi_head: gated scalar heads, V = Σ softmax(g)_h·V_h."
    )
    heads: int = Field(4, ge=2, le=256, description="H, the number of scalar heads.")

    def build(self, hidden_size: int, dtype: torch.dtype, seed: int) -> MultiValueHead:
        head = MultiValueHead(hidden_size, self.heads, device="meta", dtype=dtype)
        return _drawn(head, seed, zero=("gate.",))


class DistributionalHead(ValueHeadKind):
    """The guide's distributional value (eq 22): a categorical distribution over `atoms`
    returns evenly spaced on [v_min, v_max]; the support should cover the value targets
    (those outside are clipped to it: `critic/target_clip_frac`)."""

    kind: Literal["distributional"] = Field(
        "distributional", description="distributional: V = Σ p_i·z_i over fixed atoms."
    )
    atoms: int = Field(51, ge=2, le=4096, description="N, the number of atoms z_1..z_N.")
    v_min: float = Field(-1.0, description="z_1, the smallest representable return.")
    v_max: float = Field(1.0, description="z_N, the largest representable return.")

    @model_validator(mode="after")
    def _support_is_ordered(self) -> DistributionalHead:
        if self.v_min >= self.v_max:
            raise ValueError(
                f"v_min ({self.v_min}) must be below v_max ({self.v_max}): the atoms are evenly "
                "spaced on [v_min, v_max]; set them to the range of the returns"
            )
        return self

    def build(self, hidden_size: int, dtype: torch.dtype, seed: int) -> DistributionalValueHead:
        head = DistributionalValueHead(
            hidden_size, self.atoms, self.v_min, self.v_max, device="meta", dtype=dtype
        )
        return _drawn(head, seed)

    def loss(
        self,
        outputs: Tensor,
        values: Tensor,
        old_values: Tensor,
        targets: Tensor,
        mask: Tensor,
        *,
        clip: float,
        num_tokens: int,
    ) -> tuple[Tensor, Metrics]:
        """Cross-entropy against the two-hot target (`distributional_value_loss`); no value
        clipping (`clip` and `old_values` unused)."""
        return distributional_value_loss(
            outputs, targets, mask, v_min=self.v_min, v_max=self.v_max, num_tokens=num_tokens
        )


ValueHead = Annotated[
    Annotated[ScalarHead, Tag("scalar")]
    | Annotated[MultiHead, Tag("multi_head")]
    | Annotated[DistributionalHead, Tag("distributional")],
    tag_or("kind", "scalar"),
]
VALUE_HEAD_CLASSES = tagged_classes(ValueHead, "kind")
