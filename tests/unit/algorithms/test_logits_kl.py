"""Tests for `streamrl.algorithms.logits` and `streamrl.algorithms.kl`.

References loop over samples and tokens in Python floats (log-sum-exp with the max subtracted,
−Σ p log p, the k1/k2/k3 formulas, the EMA update element by element); gradients of the chunked
(checkpointed) paths are compared with autograd through the naive full-tensor computation.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from streamrl.algorithms.kl import ema_update_, kl_estimate
from streamrl.algorithms.logits import (
    entropy_from_logits,
    token_logprobs,
    token_logprobs_and_entropy,
)

TOL = {"atol": 1e-5, "rtol": 1e-5}
N, T, V = 2, 5, 11  # N·T = 10: chunk sizes 1, 5, 10 divide it, 3, 4 and 1024 do not
CHUNKS = [1, 3, 4, 5, 10, 1024]


def _close(actual: Tensor, expected, **tol) -> None:
    expected_t = torch.tensor(expected, dtype=torch.float64).to(actual.dtype)
    torch.testing.assert_close(actual.detach(), expected_t, **(tol or TOL))


def _logits(seed: int, dtype: torch.dtype = torch.float32, scale: float = 3.0) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(N, T, V, generator=gen)).to(dtype)


def _tokens(seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, V, (N, T), generator=gen)


def _row(logits: Tensor, n: int, t: int, temperature: float) -> list[float]:
    return [float(x) / temperature for x in logits[n, t].float().tolist()]


def _logsumexp(z: list[float]) -> float:
    top = max(z)
    return top + math.log(sum(math.exp(x - top) for x in z))


def _ref_token_logprobs(logits: Tensor, tokens: Tensor, temperature: float) -> list[list[float]]:
    out = []
    for n in range(logits.shape[0]):
        row = []
        for t in range(logits.shape[1]):
            z = _row(logits, n, t, temperature)
            row.append(z[int(tokens[n, t])] - _logsumexp(z))
        out.append(row)
    return out


def _ref_entropy(logits: Tensor, temperature: float) -> list[list[float]]:
    out = []
    for n in range(logits.shape[0]):
        row = []
        for t in range(logits.shape[1]):
            z = _row(logits, n, t, temperature)
            lse = _logsumexp(z)
            h = 0.0
            for x in z:
                logp = x - lse
                h -= math.exp(logp) * logp
            row.append(h)
        out.append(row)
    return out


def _naive_logprobs(logits: Tensor, tokens: Tensor, temperature: float) -> Tensor:
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def _naive_entropy(logits: Tensor, temperature: float, dtype=torch.float32) -> Tensor:
    logp = torch.log_softmax(logits.to(dtype) / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


# ----------------------------------------------------------------------------------------------
# token_logprobs
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("chunk_tokens", CHUNKS)
def test_token_logprobs_matches_reference(dtype, temperature, chunk_tokens):
    """log softmax(z/τ)[token] equals the loop reference and log_softmax(...).gather."""
    logits = _logits(0, dtype)
    tokens = _tokens(0)
    got = token_logprobs(logits, tokens, temperature=temperature, chunk_tokens=chunk_tokens)
    assert got.dtype == torch.float32
    assert got.shape == (N, T)
    _close(got, _ref_token_logprobs(logits, tokens, temperature))
    torch.testing.assert_close(got, _naive_logprobs(logits, tokens, temperature), **TOL)


def test_token_logprobs_hand_example():
    """z = [0, ln 3] at τ = 1 → log p = [ln ¼, ln ¾]; at τ = ½ → z/τ = [0, ln 9] → ln ⅒, ln ⁹⁄₁₀."""
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    tokens = torch.tensor([[0, 1]])
    _close(token_logprobs(logits, tokens), [[math.log(0.25), math.log(0.75)]])
    got = token_logprobs(logits, tokens, temperature=0.5, chunk_tokens=1)
    _close(got, [[math.log(0.1), math.log(0.9)]])


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_tokens", CHUNKS)
def test_token_logprobs_gradient_matches_naive(seed, temperature, chunk_tokens):
    """∂/∂logits through the checkpointed chunks equals autograd of the naive computation."""
    base = _logits(seed)
    tokens = _tokens(seed)
    upstream = torch.randn(N, T, generator=torch.Generator().manual_seed(seed))
    chunked = base.clone().requires_grad_(True)
    out = token_logprobs(chunked, tokens, temperature=temperature, chunk_tokens=chunk_tokens)
    (out * upstream).sum().backward()
    naive = base.clone().requires_grad_(True)
    (_naive_logprobs(naive, tokens, temperature) * upstream).sum().backward()
    torch.testing.assert_close(out.detach(), _naive_logprobs(base, tokens, temperature), **TOL)
    torch.testing.assert_close(chunked.grad, naive.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_tokens", CHUNKS)
def test_fused_logprobs_and_entropy_equal_the_separate_functions(dtype, temperature, chunk_tokens):
    """One fused pass gives the same log-probs, gradient and entropy as the two functions; the
    logits are left untouched and the entropy carries no gradient."""
    base = _logits(3).to(dtype)
    tokens = _tokens(3)
    upstream = torch.randn(N, T, generator=torch.Generator().manual_seed(3))
    fused_in = base.clone().requires_grad_(True)
    logp, entropy = token_logprobs_and_entropy(
        fused_in, tokens, temperature=temperature, chunk_tokens=chunk_tokens
    )
    assert not entropy.requires_grad
    (logp * upstream).sum().backward()
    ref_in = base.clone().requires_grad_(True)
    ref = token_logprobs(ref_in, tokens, temperature=temperature, chunk_tokens=chunk_tokens)
    (ref * upstream).sum().backward()
    tol = TOL if dtype == torch.float32 else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(logp.detach(), ref.detach(), **tol)
    torch.testing.assert_close(fused_in.grad, ref_in.grad, **tol)
    torch.testing.assert_close(entropy, _naive_entropy(base, temperature), **tol)
    torch.testing.assert_close(fused_in.detach(), base)


@pytest.mark.parametrize("chunk_tokens", [3, 1024])
def test_token_logprobs_gradient_bf16(chunk_tokens):
    """bf16 logits: the chunked gradient matches the naive one (within bf16 rounding)."""
    base = _logits(3, torch.bfloat16)
    tokens = _tokens(3)
    chunked = base.clone().requires_grad_(True)
    token_logprobs(chunked, tokens, temperature=0.8, chunk_tokens=chunk_tokens).sum().backward()
    naive = base.clone().requires_grad_(True)
    _naive_logprobs(naive, tokens, 0.8).sum().backward()
    assert chunked.grad.dtype == torch.bfloat16
    torch.testing.assert_close(chunked.grad.float(), naive.grad.float(), atol=1e-2, rtol=2e-2)


def test_token_logprobs_no_grad_equals_grad_path():
    """The plain (no-grad) and checkpointed paths give identical values; int32 ids accepted."""
    logits = _logits(4)
    tokens = _tokens(4)
    with torch.no_grad():
        plain = token_logprobs(logits, tokens.int(), chunk_tokens=3)
    ckpt = token_logprobs(logits.clone().requires_grad_(True), tokens, chunk_tokens=3)
    assert ckpt.requires_grad
    torch.testing.assert_close(plain, ckpt.detach(), **TOL)
    _close(plain, _ref_token_logprobs(logits, tokens, 1.0))


def test_token_logprobs_are_log_probabilities():
    """exp(log p) over every possible token sums to 1 at each position."""
    logits = _logits(5)
    total = torch.zeros(N, T)
    for v in range(V):
        ids = torch.full((N, T), v, dtype=torch.long)
        total += token_logprobs(logits, ids, temperature=0.9, chunk_tokens=3).exp()
    _close(total, [[1.0] * T for _ in range(N)])


def test_token_logprobs_empty_batch():
    """N = 0 responses gives an empty [0, T] float32 result."""
    got = token_logprobs(torch.randn(0, T, V), torch.zeros(0, T, dtype=torch.long))
    assert got.shape == (0, T)
    assert got.dtype == torch.float32


# ----------------------------------------------------------------------------------------------
# entropy_from_logits
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("chunk_tokens", CHUNKS)
def test_entropy_matches_reference(dtype, temperature, chunk_tokens):
    """H = −Σ p log p of softmax(z/τ) equals the loop reference; 0 ≤ H ≤ log V."""
    logits = _logits(6, dtype)
    got = entropy_from_logits(logits, temperature=temperature, chunk_tokens=chunk_tokens)
    assert got.dtype == torch.float32
    assert got.shape == (N, T)
    _close(got, _ref_entropy(logits, temperature))
    torch.testing.assert_close(got, _naive_entropy(logits, temperature), **TOL)
    assert torch.all(got >= -1e-6)
    assert torch.all(got <= math.log(V) + 1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.3, 2.0])
def test_entropy_uniform_logits_is_log_vocab(temperature):
    """Equal logits (any value, any τ) give H = log V."""
    logits = torch.full((N, T, V), 3.7)
    got = entropy_from_logits(logits, temperature=temperature, chunk_tokens=3)
    _close(got, [[math.log(V)] * T for _ in range(N)])


def test_entropy_peaked_and_two_point_hand_examples():
    """A two-point 50/50 distribution gives ln 2; a near one-hot gives ≈ 0 (no NaN)."""
    two_point = torch.tensor([[[0.0, 0.0, -1e4]]])
    _close(entropy_from_logits(two_point), [[math.log(2.0)]])
    one_hot = torch.tensor([[[200.0, 0.0, 0.0, 0.0]]])
    got = entropy_from_logits(one_hot)
    assert torch.isfinite(got).all()
    _close(got, [[0.0]])


@pytest.mark.parametrize("offset", [30.0, 300.0])
def test_entropy_is_exact_at_large_logit_offsets(offset):
    """Softmax is shift-invariant, so H(z + c) = H(z); at c = +30 the form lse − Σ p·z loses
    ~1e-4 in float32, the log-softmax form stays within float32 rounding of the fp64 value."""
    logits = _logits(11) * 2.0 + offset
    reference = _naive_entropy(logits.double(), 1.0, torch.float64)  # the same float32 input
    got = entropy_from_logits(logits, chunk_tokens=5)
    torch.testing.assert_close(got.double(), reference, atol=2e-6, rtol=0)


@pytest.mark.parametrize("seed", [7, 8])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_tokens", CHUNKS)
def test_entropy_gradient_matches_naive(seed, temperature, chunk_tokens):
    """∂H/∂logits through the checkpointed chunks equals autograd of −Σ p log p (in fp64)."""
    base = _logits(seed)
    upstream = torch.randn(N, T, generator=torch.Generator().manual_seed(seed))
    chunked = base.clone().requires_grad_(True)
    out = entropy_from_logits(chunked, temperature=temperature, chunk_tokens=chunk_tokens)
    (out * upstream).sum().backward()
    # fp64 reference: the fp32 forms lse − Σ p·z and −Σ p·log p round differently (~1e-6).
    naive = base.double().requires_grad_(True)
    (_naive_entropy(naive, temperature, torch.float64) * upstream.double()).sum().backward()
    torch.testing.assert_close(chunked.grad.double(), naive.grad, **TOL)


def test_entropy_gradient_bf16():
    """bf16 logits: entropy gradient through chunks matches the naive one (bf16 rounding)."""
    base = _logits(9, torch.bfloat16)
    chunked = base.clone().requires_grad_(True)
    entropy_from_logits(chunked, temperature=1.3, chunk_tokens=3).sum().backward()
    naive = base.clone().requires_grad_(True)
    _naive_entropy(naive, 1.3).sum().backward()
    assert chunked.grad.dtype == torch.bfloat16
    torch.testing.assert_close(chunked.grad.float(), naive.grad.float(), atol=1e-2, rtol=2e-2)


# ----------------------------------------------------------------------------------------------
# kl_estimate
# ----------------------------------------------------------------------------------------------


def _ref_kl(d: float, estimator: str) -> tuple[float, float]:
    """(k, ∂k/∂logp) for d = logp − logp_ref."""
    if estimator == "k1":
        return d, 1.0
    if estimator == "k2":
        return 0.5 * d * d, d
    return math.exp(-d) + d - 1.0, 1.0 - math.exp(-d)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimate_matches_formula_and_gradient(seed, estimator):
    """k1 = d, k2 = ½d², k3 = e^{−d} + d − 1; gradient flows to logp only."""
    gen = torch.Generator().manual_seed(seed)
    logp = (-3.0 * torch.rand(4, 6, generator=gen)).requires_grad_(True)
    logp_ref = (logp.detach() + torch.randn(4, 6, generator=gen)).requires_grad_(True)
    got = kl_estimate(logp, logp_ref, estimator)
    got.sum().backward()
    values, grads = [], []
    for row_p, row_r in zip(logp.tolist(), logp_ref.tolist(), strict=True):
        pairs = [_ref_kl(p - r, estimator) for p, r in zip(row_p, row_r, strict=True)]
        values.append([k for k, _ in pairs])
        grads.append([g for _, g in pairs])
    _close(got, values)
    _close(logp.grad, grads)
    assert logp_ref.grad is None


def test_kl_estimate_hand_example():
    """d = ln 2: k1 = ln 2, k2 = ½ ln² 2, k3 = ½ + ln 2 − 1; d = 0 gives 0 for all."""
    logp = torch.tensor([[math.log(2.0) - 1.0, -0.5]])
    ref = torch.tensor([[-1.0, -0.5]])
    ln2 = math.log(2.0)
    _close(kl_estimate(logp, ref, "k1"), [[ln2, 0.0]])
    _close(kl_estimate(logp, ref, "k2"), [[0.5 * ln2 * ln2, 0.0]])
    _close(kl_estimate(logp, ref, "k3"), [[0.5 + ln2 - 1.0, 0.0]])


def test_kl_k3_nonnegative_and_float32():
    """k3 ≥ 0 over a wide range of d (k1 goes negative there); bf16 inputs give fp32."""
    gen = torch.Generator().manual_seed(3)
    d = 2.0 * torch.randn(64, 64, generator=gen)
    ref = -torch.rand(64, 64, generator=gen)
    k3 = kl_estimate(ref + d, ref, "k3")
    assert torch.all(k3 >= 0.0)
    assert torch.any(kl_estimate(ref + d, ref, "k1") < 0.0)
    out = kl_estimate(torch.zeros(2, 2, dtype=torch.bfloat16), torch.ones(2, 2), "k3")
    assert out.dtype == torch.float32
    _close(out, [[math.exp(1.0) - 2.0] * 2] * 2, atol=1e-6, rtol=1e-6)


def test_kl_estimate_rejects_unknown_estimator():
    """An unknown estimator name raises ValueError."""
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


# ----------------------------------------------------------------------------------------------
# ema_update_
# ----------------------------------------------------------------------------------------------


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(3, 4), (5,), ()]
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


@pytest.mark.parametrize("tau", [0.0, 0.3, 0.9, 0.999, 1.0])
def test_ema_update_matches_formula_in_place(tau):
    """θ_ref ← τ·θ_ref + (1 − τ)·θ element by element, in place; the policy is untouched."""
    reference = _params(0)
    policy = _params(1)
    ref_before = [p.detach().clone() for p in reference]
    pol_before = [p.detach().clone() for p in policy]
    ptrs = [p.data_ptr() for p in reference]
    ema_update_(reference, policy, tau)
    for r, r0, p0, ptr in zip(reference, ref_before, pol_before, ptrs, strict=True):
        assert r.data_ptr() == ptr
        expected = [
            tau * a + (1.0 - tau) * b
            for a, b in zip(r0.reshape(-1).tolist(), p0.reshape(-1).tolist(), strict=True)
        ]
        _close(r.reshape(-1), expected, atol=1e-6, rtol=1e-6)
    for p, p0 in zip(policy, pol_before, strict=True):
        assert torch.equal(p.detach(), p0)


def test_ema_update_tau_zero_copies_and_one_keeps():
    """τ = 0 copies the policy exactly; τ = 1 leaves the reference exactly as it was."""
    reference = _params(2)
    policy = _params(3)
    before = [p.detach().clone() for p in reference]
    ema_update_(reference, policy, 1.0)
    assert all(torch.equal(r.detach(), b) for r, b in zip(reference, before, strict=True))
    ema_update_(reference, policy, 0.0)
    assert all(torch.equal(r.detach(), p.detach()) for r, p in zip(reference, policy, strict=True))


def test_ema_update_accepts_module_parameter_generators():
    """Generators such as Module.parameters() work; two steps compose as τ²·ref + (1 − τ²)·θ."""
    torch.manual_seed(0)
    ref_model = torch.nn.Linear(3, 2)
    policy = torch.nn.Linear(3, 2)
    w0 = ref_model.weight.detach().clone()
    for _ in range(2):
        ema_update_(ref_model.parameters(), policy.parameters(), 0.5)
    expected = [
        0.25 * a + 0.75 * b
        for a, b in zip(w0.reshape(-1).tolist(), policy.weight.reshape(-1).tolist(), strict=True)
    ]
    _close(ref_model.weight.reshape(-1), expected, atol=1e-6, rtol=1e-6)


def test_ema_update_rejects_mismatched_lengths():
    """Different numbers of tensors raise ValueError and leave the reference unchanged."""
    reference = _params(4)
    before = [p.detach().clone() for p in reference]
    with pytest.raises(ValueError, match="tensors"):
        ema_update_(reference, _params(5)[:2], 0.5)
    assert all(torch.equal(r.detach(), b) for r, b in zip(reference, before, strict=True))


@pytest.mark.parametrize("tau", [-0.1, 1.01, 2.0, math.nan])
def test_ema_update_rejects_tau_outside_unit_interval(tau):
    """τ outside [0, 1] raises ValueError before touching the reference."""
    reference = _params(6)
    before = [p.detach().clone() for p in reference]
    with pytest.raises(ValueError, match="tau"):
        ema_update_(reference, _params(7), tau)
    assert all(torch.equal(r.detach(), b) for r, b in zip(reference, before, strict=True))
