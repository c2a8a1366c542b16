"""Forward rows for a micro-batch: each prompt computed once for all of its responses.

A *unit* is one prompt and k of the responses sampled from it (TrainBatch rows). Its row is the
prompt once, then each response in turn: `prompt · r₁ · r₂ · … · r_k`. Each response attends
causally to the prompt and to itself only (a block mask), and its position ids continue from the
prompt (P, P+1, …) as if it followed the prompt alone, so every hidden state equals the one the
response's own sequence `prompt · r_i` would give; the prompt positions' gradients add up over
the k responses exactly as they would over k copies. A unit of one response is today's
`prompt · response` row; rows of only such units need no block mask (a 2-D padding mask does).

`forward_rows(batch, units)` builds the rows of one micro-batch and, for the per-response view
of `MicroBatch` (`[n, T−1]`: response i, target position j), `gather[i, j]`: the flat index
(row · S + position) of the hidden state that scores `targets[i, j]`, valid where
`response_mask`. The first response token is scored by the prompt's last position (shared),
every later one by the response's previous token.

Who attends to whom is one rule, `attends` (a FlexAttention mask function over the rows'
`segments`), given to the attention kernel in the form it takes (`shared_prompt_mask`): SDPA a
dense boolean `[R, 1, S, S]` mask, FlexAttention a `BlockMask` (only the blocks a row's
responses and prompt touch are computed).

A multi-turn response's environment tokens (tool results, user turns) are response tokens here
like any other: in the row, attended to by the tokens after them, given a `gather` index; the
learner scores only the sampled ones (`MicroBatch.sampled_mask`), so they never enter a loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

__all__ = ["ForwardRows", "attends", "forward_rows", "shared_prompt_mask"]

PAD_ID = 0


@dataclass(frozen=True)
class ForwardRows:
    """What the model runs on, for a micro-batch whose responses are `rows` (in this order).

    input_ids       `[R, S] int64`        the units' tokens, right-padded with PAD_ID
    attention_mask  `[R, S] int64`        1 on real tokens (rows of one response each), or
    segments        `[R, S] int64`        when a unit shares its prompt: −1 padding, 0 the
                                          prompt, i + 1 the unit's response i (`attends`)
    position_ids    `[R, S] int64`        positions as in each response's own sequence
    gather          `[n, T−1] int64`      flat index of the hidden state scoring target (i, j)
    """

    input_ids: Tensor
    attention_mask: Tensor
    segments: Tensor | None
    position_ids: Tensor
    gather: Tensor


def forward_rows(
    prompt_length: Tensor,
    response_length: Tensor,
    tokens: Tensor,
    seq_start: Tensor,
    units: list[Tensor],
    view_length: int,
) -> ForwardRows:
    """The forward rows of `units` (each a `[k] int64` tensor of TrainBatch rows sharing one
    prompt; their concatenation is the micro-batch's responses, in order), from the batch's
    per-response `prompt_length`, `response_length`, flat `tokens` and `seq_start` (see
    `TrainBatch`). `view_length` is T − 1 of the per-response view. Vectorised per unit."""
    lengths = [int(prompt_length[u[0]]) + int(response_length[u].sum()) for u in units]
    rows, width = len(units), max(lengths)
    input_ids = torch.full((rows, width), PAD_ID, dtype=torch.long)
    position_ids = torch.zeros((rows, width), dtype=torch.long)
    segment = torch.full((rows, width), -1, dtype=torch.long)  # 0 prompt, i + 1 response i
    n = sum(len(u) for u in units)
    gather = torch.zeros((n, view_length), dtype=torch.long)
    j = torch.arange(view_length)
    first = 0
    for r, unit in enumerate(units):
        P = int(prompt_length[unit[0]])
        start = int(seq_start[unit[0]])
        input_ids[r, :P] = tokens[start : start + P]
        position_ids[r, :P] = torch.arange(P)
        segment[r, :P] = 0
        offset = P
        for i, row in enumerate(unit.tolist()):
            L = int(response_length[row])
            begin = int(seq_start[row]) + P
            input_ids[r, offset : offset + L] = tokens[begin : begin + L]
            position_ids[r, offset : offset + L] = torch.arange(P, P + L)
            segment[r, offset : offset + L] = i + 1
            # target j = P − 1 + k: scored by the prompt's last position (k = 0), else by the
            # response's token k − 1, at offset + k − 1 in the row
            k = j - (P - 1)
            at = torch.where(k == 0, P - 1, offset + k - 1)
            valid = (k >= 0) & (k < L)
            gather[first + i] = torch.where(valid, r * width + at, 0)
            offset += L
        first += len(unit)
    real = segment >= 0
    shared = None if all(len(u) == 1 for u in units) else segment
    return ForwardRows(input_ids, real.long(), shared, position_ids, gather)


def attends(segments: Tensor) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """The mask function of shared-prompt rows with `segments` `[R, S]` (FlexAttention's
    `mask_mod(row, head, query, key)`; it broadcasts, so it also builds the dense mask): a token
    attends causally to its own segment and to the prompt; padding attends to itself only (a
    row with nothing to attend to would turn attention into NaN)."""

    def mask_mod(row: Tensor, head: Tensor, query: Tensor, key: Tensor) -> Tensor:
        seen, seer = segments[row, key], segments[row, query]
        shared = (query >= key) & (seen >= 0) & (seer >= 0) & ((seen == 0) | (seen == seer))
        return shared | ((query == key) & (seer < 0))

    return mask_mod


def shared_prompt_mask(segments: Tensor, implementation: str | None) -> Tensor | BlockMask:
    """`attends` over `segments` in the form the attention `implementation` takes, on the
    segments' device: a `BlockMask` for FlexAttention (`flex_attention`), else a dense boolean
    `[R, 1, S, S]` mask (SDPA)."""
    rows, width = segments.shape
    mask_mod = attends(segments)
    if implementation == "flex_attention":
        # Compiled on CUDA, the mask is evaluated block by block; uncompiled it is materialised
        # whole ([R, S, S] per intermediate), which only tiny CPU checks can afford.
        return create_block_mask(
            mask_mod, rows, None, width, width, device=segments.device,
            _compile=segments.device.type == "cuda",
        )  # fmt: skip
    at = torch.arange(width, device=segments.device)
    row = torch.arange(rows, device=segments.device)[:, None, None]
    return mask_mod(row, None, at[None, :, None], at[None, None, :])[:, None]
