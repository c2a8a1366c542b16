"""What a publisher hands the weight store: tensors as pieces (`TensorShare`), checked finite.

`whole_shares` turns a state dict into one piece per tensor (a single process's publish); the
learner's ranks build their pieces from their FSDP2 shards (`streamrl.learner.publish`).
`non_finite` is the one NaN/inf check: the store runs it on every share it is given, the
learner on its shards before anything is snapshot.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping

import torch

from storage.weights.pieces import TensorShare

__all__ = [
    "NonFiniteWeightsError",
    "TensorShare",
    "check_finite",
    "new_publish_id",
    "non_finite",
    "non_finite_message",
    "whole_shares",
]


class NonFiniteWeightsError(ValueError):
    """Weights to publish hold NaN or ±inf; nothing of that version was written."""


def new_publish_id() -> str:
    """A fresh id for one publishing learner life (file names of its versions start with it)."""
    return uuid.uuid4().hex[:12]


def non_finite(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of floating-point tensors holding NaN or ±inf. One min/max reduction per
    tensor (NaN propagates through both; ±inf is an extreme), one device sync in all: 20× the
    speed of `isfinite(t).all()`, which builds a boolean copy of every tensor."""
    floats = {n: t for n, t in tensors.items() if t.is_floating_point() and t.numel()}
    if not floats:
        return []
    extremes = [torch.stack(torch.aminmax(t.detach())).float() for t in floats.values()]
    finite = torch.isfinite(torch.stack(extremes)).all(dim=1).tolist()
    return [name for name, ok in zip(floats, finite, strict=True) if not ok]


def check_finite(version: int, tensors: Mapping[str, torch.Tensor]) -> None:
    """Refuse NaN/inf weights before anything is uploaded: generators would sample garbage."""
    if bad := non_finite(tensors):
        raise NonFiniteWeightsError(non_finite_message(version, bad, len(bad)))


def non_finite_message(version: int, names: list[str], count: int) -> str:
    """What a refused publish says: which tensors, and what to do."""
    shown = ", ".join(names[:5]) + (f" and {count - 5} more" if count > 5 else "")
    return (
        f"refusing to publish weights v{version}: {count} tensor(s) hold NaN or inf "
        f"({shown or 'on other ranks'}). Nothing was written and LATEST is unchanged; the "
        "training that produced them diverged (lower learner.lr, keep learner.grad_clip on) — "
        "resume from the last committed checkpoint"
    )


def whole_shares(
    state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None
) -> dict[str, TensorShare]:
    """Each tensor of `state_dict` as one piece (what a single process publishes), on CPU,
    cast to `dtype` if given; tied tensors get their own copies."""
    shares: dict[str, TensorShare] = {}
    for name, value in state_dict.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"state_dict keys must be non-empty strings, got {name!r}")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] is a {type(value).__name__}, not a Tensor")
        data = value.detach()
        if dtype is not None and data.is_floating_point():
            data = data.to(dtype)
        data = data.to("cpu").reshape(-1).clone()
        shares[name] = TensorShare(data, 0, tuple(value.shape))
    return shares
