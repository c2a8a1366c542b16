"""Log-probs of sampled tokens and entropy from logits, memory-frugal for large vocabularies.

A full fp32 `log_softmax` over `[N, T, V]` logits costs 4·N·T·V bytes (1.2 GB for 8k tokens of
a 150k vocabulary) and autograd keeps it alive. Here rows are processed in chunks of
`chunk_tokens` tokens: each chunk is upcast to fp32, reduced to one log-sum-exp per token and
discarded. Under autograd every chunk is recomputed in the backward pass
(`torch.utils.checkpoint`), so peak extra memory is one chunk, not the whole batch.

`token_logprobs_and_entropy` does both in one pass (one log-sum-exp per token, kept for the
backward pass, which is one fused softmax pass per chunk): the learner's hot path when the
entropy is a metric, not a loss term.

`head_logprobs_and_entropy` goes one step further: the LM head itself, applied only to the hidden
states that score a token (a response's, not the prompt's), chunk by chunk.

All functions divide the logits by `temperature` first: the generator samples from
softmax(z / τ) and stores that distribution's log-probs, so the learner must score the same one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

__all__ = [
    "entropy_from_logits",
    "head_logprobs_and_entropy",
    "token_logprobs",
    "token_logprobs_and_entropy",
]

DEFAULT_CHUNK_TOKENS = 1024


def _chunked(
    fn: Callable[..., Tensor], logits: Tensor, *extra: Tensor, chunk_tokens: int
) -> Tensor:
    """Apply `fn(logits_chunk [c, V], *extra_chunks) -> [c]` over flattened token rows."""
    lead_shape = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    flat_extra = [e.reshape(-1) for e in extra]
    use_checkpoint = torch.is_grad_enabled() and logits.requires_grad
    outputs = []
    for start in range(0, flat.shape[0], chunk_tokens):
        chunk = flat[start : start + chunk_tokens]
        chunk_extra = [e[start : start + chunk_tokens] for e in flat_extra]
        if use_checkpoint:
            outputs.append(checkpoint(fn, chunk, *chunk_extra, use_reentrant=False))
        else:
            outputs.append(fn(chunk, *chunk_extra))
    if not outputs:
        return torch.zeros(lead_shape, dtype=torch.float32, device=logits.device)
    return torch.cat(outputs).reshape(lead_shape)


def token_logprobs(
    logits: Tensor,
    tokens: Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> Tensor:
    """log softmax(z / τ)[token] for every position.

    Args:
        logits: `[N, T, V]` (any float dtype); position t scores `tokens[:, t]`.
        tokens: `[N, T]` int64 token ids.

    Returns `[N, T]` float32.
    """

    def chunk_logprobs(z: Tensor, ids: Tensor) -> Tensor:
        z = z.float() / temperature
        picked = z.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(z, dim=-1)

    return _chunked(chunk_logprobs, logits, tokens.long(), chunk_tokens=chunk_tokens)


def entropy_from_logits(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> Tensor:
    """Entropy H = −Σ_v p_v · log p_v of p = softmax(z / τ) per position.

    Computed from the shifted log-probs log p = z − logsumexp(z): the equal form
    logsumexp(z) − Σ p·z subtracts two numbers of the size of the logits and loses ~1e-4 in
    float32 once they sit near +30.

    `logits: [N, T, V]` → `[N, T]` float32, differentiable.
    """

    def chunk_entropy(z: Tensor) -> Tensor:
        log_probs = torch.log_softmax(z.float() / temperature, dim=-1)
        return -(log_probs.exp() * log_probs).sum(-1)

    return _chunked(chunk_entropy, logits, chunk_tokens=chunk_tokens)


def _scores(logits: Tensor, ids: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk of logit rows `[c, V]` (any dtype) → its log-sum-exp, log p(ids) and entropy
    under softmax(z / τ), each `[c]` float32. The logits stay untouched."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    log_probs = z - lse[:, None]
    logp = log_probs.gather(-1, ids[:, None]).squeeze(-1)
    return lse, logp, -(log_probs.exp() * log_probs).sum(-1)


class _LogprobsAndEntropy(torch.autograd.Function):
    """log p(token) (differentiable) and H (a metric, no gradient) over `[M, V]` logit rows,
    chunk by chunk; saves one log-sum-exp per row for the backward pass."""

    @staticmethod
    def forward(ctx, logits: Tensor, ids: Tensor, temperature: float, chunk: int):
        rows = logits.shape[0]
        logp = torch.empty(rows, dtype=torch.float32, device=logits.device)
        entropy = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        for start in range(0, rows, chunk):
            part = slice(start, start + chunk)
            lse[part], logp[part], entropy[part] = _scores(logits[part], ids[part], temperature)
        ctx.save_for_backward(logits, ids, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, _grad_entropy: Tensor):
        logits, ids, lse = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], chunk):
            part = slice(start, start + chunk)
            z = logits[part].float()
            if temperature != 1.0:
                z = z / temperature
            g = grad_logp[part].float()
            # d logp / dz = (onehot − softmax) / τ
            piece = (z - lse[part, None]).exp_().mul_(-g[:, None])
            piece.scatter_add_(-1, ids[part, None], g[:, None])
            if temperature != 1.0:
                piece.div_(temperature)
            grad[part] = piece
        return grad, None, None, None


def token_logprobs_and_entropy(
    logits: Tensor,
    tokens: Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[Tensor, Tensor]:
    """`token_logprobs` (differentiable) and `entropy_from_logits` (detached) in one pass.

    `logits: [N, T, V]`, `tokens: [N, T]` → two `[N, T]` float32 tensors. Same values as the
    two functions; the gradient of the log-probs is computed in one fused pass per chunk."""
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    logp, entropy = _LogprobsAndEntropy.apply(
        flat, tokens.reshape(-1).long(), float(temperature), chunk_tokens
    )
    return logp.reshape(lead), entropy.reshape(lead)


class _HeadLogprobsAndEntropy(torch.autograd.Function):
    """The LM head fused with `_LogprobsAndEntropy`: from hidden-state rows `[M, H]` and the
    head's weight `[V, H]`, log p(token) and H per row, one chunk of logits `[c, V]` at a time
    (never `[M, V]` whole), recomputed in the backward pass. The entropy has a gradient when
    `entropy_grad` (an entropy loss term), else it is a metric."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, temperature: float, chunk: int, entropy_grad: bool):
        rows = hidden.shape[0]
        logp = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        for start in range(0, rows, chunk):
            part = slice(start, start + chunk)
            z = hidden[part] @ weight.t()
            lse[part], logp[part], entropy[part] = _scores(z, ids[part], temperature)
        ctx.save_for_backward(hidden, weight, ids, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.entropy_grad = temperature, chunk, entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, grad_entropy: Tensor | None):
        hidden, weight, ids, lse, entropy = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        with_entropy = ctx.entropy_grad and grad_entropy is not None
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], chunk):
            part = slice(start, start + chunk)
            h = hidden[part]
            z = (h @ weight.t()).float()
            if temperature != 1.0:
                z = z / temperature
            log_probs = z - lse[part, None]
            probs = log_probs.exp()
            g = grad_logp[part].float()
            # d logp / du = onehot − p, with u = z / τ
            dz = probs * -g[:, None]
            dz.scatter_add_(-1, ids[part, None], g[:, None])
            if with_entropy:  # dH / du = −p · (log p + H)
                ge = grad_entropy[part].float()
                dz -= probs * (log_probs + entropy[part, None]) * ge[:, None]
            if temperature != 1.0:
                dz /= temperature
            if grad_hidden is not None:
                grad_hidden[part] = (dz @ weight.float()).to(hidden.dtype)
            grad_weight += dz.t() @ h.float()
        grad_weight = grad_weight.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None, None, None


def head_logprobs_and_entropy(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor]:
    """Log-probs of `tokens` and entropies under softmax(hidden · weightᵀ / τ), the LM head
    applied only to the given rows: `hidden: [M, H]` (the hidden states that score a token),
    `weight: [V, H]`, `tokens: [M]` → two `[M]` float32 tensors. Log-probs are differentiable
    (in `hidden` and `weight`); the entropy too when `entropy_grad`. Equal to
    `token_logprobs_and_entropy(hidden @ weight.T, tokens)` without ever holding the `[M, V]`
    logits: one chunk of `chunk_tokens` rows at a time, recomputed in the backward pass."""
    return _HeadLogprobsAndEntropy.apply(
        hidden, weight, tokens.long(), float(temperature), chunk_tokens, entropy_grad
    )
