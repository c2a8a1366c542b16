"""The policy's and the critic's forward passes over a micro-batch, scored only where a loss
needs them.

`token_scores(model, micro)` returns log p(target) and the entropy at every sampled response
target of the micro-batch's per-response view (`micro.sampled_mask`, `[n, T−1]`, zero
elsewhere), from its forward rows (one per response, or shared-prompt rows:
`streamrl.learner.packing`). Environment tokens of a multi-turn response are in the rows and
attended to, never scored: no loss term reads them. A causal LM whose output
layer is a `HiddenStatesHead` (`use_hidden_states_head`, what the learner trains) returns its
final hidden states; the LM head is then applied only to the hidden states that score a
response token, chunk by chunk (`head_logprobs_and_entropy`): no logits for prompt positions,
never the `[tokens, vocab]` logits whole. Any other causal LM computes its full logits, of
which the response positions are read: the reference path the fast one is checked against.

`values(critic, micro)`: the critic's V at the same positions; `value_outputs(critic, micro)`:
its value head's outputs there (what the critic's loss reads) and V from them.

Under FSDP2 the root unit keeps its parameters gathered from its forward to its backward
(`shard_model`), so the output layer's weight read after the forward is the whole weight.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from streamrl.algorithms.logits import (
    entropy_from_logits,
    head_logprobs_and_entropy,
    token_logprobs_and_entropy,
)
from streamrl.learner.mini_batches import MicroBatch
from streamrl.learner.packing import shared_prompt_mask

__all__ = [
    "HiddenStatesHead",
    "attention_implementation",
    "set_attention",
    "shares_prompts",
    "token_scores",
    "use_hidden_states_head",
    "value_outputs",
    "values",
]

# Attention implementations that take shared-prompt rows' mask (`packing.shared_prompt_mask`).
BLOCK_MASK_ATTENTION = frozenset({"sdpa", "flex_attention"})


class HiddenStatesHead(nn.Module):
    """A causal LM's output layer that passes the final hidden states through: its forward's
    `logits` are the hidden states `[R, S, H]`. It keeps the output layer's weight (the same
    parameter under the same name, `lm_head.weight`, tied to the input embeddings when they
    were), for `token_scores` to apply where a loss needs it."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, hidden: Tensor) -> Tensor:
        # A copy, not the caller's view: FSDP2 hooks the root's output for its backward, which
        # a view would not keep safely (it warns).
        return hidden.clone()


def use_hidden_states_head(model: nn.Module) -> nn.Module:
    """Give the causal LM `model` a `HiddenStatesHead` in place of its output layer (before
    sharding it); returns `model`. Refuses an output layer with a bias."""
    head = model.get_output_embeddings()
    if isinstance(head, HiddenStatesHead):
        return model
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise ValueError(
            f"the model's output layer is {type(head).__name__}"
            f"{' with a bias' if getattr(head, 'bias', None) is not None else ''}: the learner "
            "scores tokens with a bias-free linear LM head only"
        )
    model.set_output_embeddings(HiddenStatesHead(head.weight))
    return model


def attention_implementation(setting: str, device: torch.device) -> str:
    """`learner.attention` on `device`: `auto` is SDPA (on CUDA until FlexAttention is measured
    faster there: benchmarks/RESULTS.md); FlexAttention is refused off CUDA (PyTorch has no
    backward for it on CPU)."""
    if setting == "flex_attention" and device.type != "cuda":
        raise ValueError(
            f"learner.attention=flex_attention needs a CUDA device (FlexAttention has no backward "
            f"pass on {device.type}); set learner.attention=sdpa or auto"
        )
    return "sdpa" if setting == "auto" else setting


def set_attention(model: nn.Module, implementation: str) -> nn.Module:
    """Run `model`'s attention (a causal LM's or a `ValueModel`'s transformer) with
    `implementation` (transformers' name: sdpa, flex_attention, eager); returns `model`.
    Meta and sharded models alike: it is read at each forward."""
    model.base_model.set_attn_implementation(implementation)
    return model


def _attention(model: nn.Module) -> str | None:
    """The attention implementation `model` runs (None: not a transformers model)."""
    config = getattr(getattr(model, "base_model", model), "config", None)
    return getattr(config, "_attn_implementation", None)


def shares_prompts(model: nn.Module, setting: str) -> bool:
    """Whether the learner packs each group's prompt once (`learner.shared_prompt`): `auto`
    where the model's attention takes a block mask, `on` (refused where it does not), `off`."""
    attention = _attention(model)
    supported = attention in BLOCK_MASK_ATTENTION
    if setting == "on" and not supported:
        raise ValueError(
            f"learner.shared_prompt=on needs attention that takes a block mask "
            f"({', '.join(sorted(BLOCK_MASK_ATTENTION))}), but the model uses {attention!r}; "
            "set learner.shared_prompt=auto or off"
        )
    return setting == "on" or (setting == "auto" and supported)


def _inputs(model: nn.Module, micro: MicroBatch) -> dict[str, Tensor]:
    mask = micro.attention_mask
    if micro.segments is not None:  # shared-prompt rows: the mask the attention takes
        mask = shared_prompt_mask(micro.segments, _attention(model))
    return {
        "input_ids": micro.input_ids,
        "attention_mask": mask,
        "position_ids": micro.position_ids,
    }


def _scatter(rows: Tensor, mask: Tensor) -> Tensor:
    """`rows` `[count, *rest]` (one per True of `mask`) into a zero tensor `[*mask.shape,
    *rest]`."""
    return rows.new_zeros((*mask.shape, *rows.shape[1:])).index_put((mask,), rows)


def token_scores(
    model: nn.Module,
    micro: MicroBatch,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor]:
    """log p(targets) (differentiable) and entropies (differentiable when `entropy_grad`) at
    the sampled response targets of `micro` (`sampled_mask`): two `[n, T−1]` float32 tensors,
    zero elsewhere (environment tokens included)."""
    mask = micro.sampled_mask
    where = micro.gather[mask]
    output = model(**_inputs(model, micro), use_cache=False).logits  # [R, S, H] or [R, S, V]
    rows = output.reshape(-1, output.shape[-1])[where]
    ids = micro.targets[mask]
    head = model.get_output_embeddings()
    if isinstance(head, HiddenStatesHead):
        logp, entropy = head_logprobs_and_entropy(
            rows, head.weight, ids, temperature=temperature, chunk_tokens=chunk_tokens,
            entropy_grad=entropy_grad,
        )  # fmt: skip
    else:
        logp, entropy = token_logprobs_and_entropy(
            rows, ids, temperature=temperature, chunk_tokens=chunk_tokens
        )
        if entropy_grad:  # the entropy as a loss term needs its own gradient
            entropy = entropy_from_logits(rows, temperature=temperature, chunk_tokens=chunk_tokens)
    return _scatter(logp, mask), _scatter(entropy, mask)


def values(critic: nn.Module, micro: MicroBatch) -> Tensor:
    """V of the state each sampled response target is chosen in (`sampled_mask`): `[n, T−1]`
    float32, zero elsewhere."""
    mask = micro.sampled_mask
    output = critic(**_inputs(critic, micro))  # [R, S]
    return _scatter(output.reshape(-1)[micro.gather[mask]], mask)


def value_outputs(critic: nn.Module, micro: MicroBatch) -> tuple[Tensor, Tensor]:
    """The critic's value-head outputs (`ValueModel.forward(..., outputs=True)`) and V from
    them (`ValueModel.value`) at the sampled response targets of `micro`: `[n, T−1, K]` and
    `[n, T−1]` float32, both differentiable and zero elsewhere."""
    mask = micro.sampled_mask
    output = critic(**_inputs(critic, micro), outputs=True)  # [R, S, K]
    rows = output.reshape(-1, output.shape[-1])[micro.gather[mask]]
    return _scatter(rows, mask), _scatter(critic.value(rows), mask)
