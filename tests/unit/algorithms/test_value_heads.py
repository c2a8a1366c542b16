"""The critic's value heads (`algorithm.value_head`): the two-hot projection and the
distributional loss, V of the distributional and multi-head heads, each against a loop
reference written here; the scalar head against the head the critic had before head kinds
(same draw, same outputs); and the configuration's errors."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from streamrl.algorithms.losses import distributional_value_loss, two_hot, value_loss
from streamrl.algorithms.value_heads import DistributionalHead, MultiHead, ScalarHead
from streamrl.config.base import ConfigError
from streamrl.config.loading import load_config
from streamrl.learner.model import critic_init
from tests.unit.algorithms.loss_reference import as_leaf, close, ragged_mask

V_MIN, V_MAX, ATOMS = -1.0, 2.0, 7  # Δ = 0.5: atoms −1, −0.5, 0, 0.5, 1, 1.5, 2


def _ref_atoms(v_min: float, v_max: float, n: int) -> list[float]:
    return [v_min + i * (v_max - v_min) / (n - 1) for i in range(n)]


def _ref_two_hot(t: float, v_min: float, v_max: float, n: int) -> list[float]:
    """Clip t to [v_min, v_max]; between z_j and z_{j+1}: (z_{j+1} − t)/Δ on j, (t − z_j)/Δ
    on j + 1."""
    z = _ref_atoms(v_min, v_max, n)
    delta = z[1] - z[0]
    t = min(max(t, v_min), v_max)
    mass = [0.0] * n
    for j in range(n - 1):
        if z[j] <= t <= z[j + 1]:
            mass[j] = (z[j + 1] - t) / delta
            mass[j + 1] = (t - z[j]) / delta
            return mass
    raise AssertionError("unreachable: t is clipped into the support")


def _ref_log_softmax(row: list[float]) -> list[float]:
    top = max(row)
    log_sum = top + math.log(sum(math.exp(x - top) for x in row))
    return [x - log_sum for x in row]


def test_two_hot_matches_the_loop_reference():
    targets = [0.2, -0.7, 1.9, 0.5, -1.0, 2.0, -3.0, 5.0, 0.0, 1.25]
    #          between atoms        on atoms    at/below v_min, above v_max
    projection = two_hot(torch.tensor(targets), V_MIN, V_MAX, ATOMS)
    expected = [_ref_two_hot(t, V_MIN, V_MAX, ATOMS) for t in targets]
    torch.testing.assert_close(projection, torch.tensor(expected), atol=1e-6, rtol=0)
    assert projection[3, 3].item() == pytest.approx(1.0, abs=1e-6)  # 0.5 is atom 3
    assert projection[6, 0].item() == 1.0  # −3 clipped to v_min
    assert projection[7, -1].item() == 1.0  # 5 clipped to v_max
    # The expectation of the projection is the (clipped) target.
    atoms = torch.tensor(_ref_atoms(V_MIN, V_MAX, ATOMS))
    clipped = torch.tensor(targets).clamp(V_MIN, V_MAX)
    torch.testing.assert_close((projection * atoms).sum(-1), clipped, atol=1e-6, rtol=0)


def _random_distributional(seed: int, N: int = 5, T: int = 6):
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(gen, N, T)
    logits = 2.0 * torch.randn(N, T, ATOMS, generator=gen)
    targets = 2.5 * torch.randn(N, T, generator=gen) + 0.5  # some beyond [v_min, v_max]
    return logits, targets, mask


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("num_tokens", [None, 40.0])
def test_distributional_loss_matches_the_loop_reference(seed, num_tokens):
    """−Σ proj·log p per token, token-mean over `num_tokens`: loss, its gradient in the logits
    (scale·(p − proj)), and the metrics."""
    logits, targets, mask = _random_distributional(seed)
    leaf = as_leaf(logits)
    loss, metrics = distributional_value_loss(
        leaf, targets, mask, v_min=V_MIN, v_max=V_MAX, num_tokens=num_tokens
    )
    loss.backward()
    L, Vt, m = logits.tolist(), targets.tolist(), mask.tolist()
    denom = max(sum(map(sum, m)) if num_tokens is None else num_tokens, 1.0)
    total, outside = 0.0, 0.0
    grad = [[[0.0] * ATOMS for _ in row] for row in L]
    for i in range(len(L)):
        for t in range(len(L[i])):
            if not m[i][t]:
                continue
            proj = _ref_two_hot(Vt[i][t], V_MIN, V_MAX, ATOMS)
            log_p = _ref_log_softmax(L[i][t])
            total += -sum(q * lp for q, lp in zip(proj, log_p, strict=True))
            grad[i][t] = [(math.exp(lp) - q) / denom for q, lp in zip(proj, log_p, strict=True)]
            outside += not (V_MIN <= Vt[i][t] <= V_MAX)
    close(loss, total / denom)
    close(leaf.grad, grad)
    close(metrics["critic/vf_loss"], total / denom)
    close(metrics["critic/target_clip_frac"], outside / max(sum(map(sum, m)), 1.0))
    assert 0 < outside < sum(map(sum, m))  # clipped and unclipped targets both exercised
    assert set(metrics) == {"critic/vf_loss", "critic/explained_var", "critic/target_clip_frac"}


def test_distributional_micro_batch_losses_sum_to_the_whole():
    """With the global denominator, the micro-batches' losses and gradients are exact shares."""
    logits, targets, mask = _random_distributional(7, N=6)
    num_tokens = mask.sum().item()
    whole_leaf = as_leaf(logits)
    whole, _ = distributional_value_loss(
        whole_leaf, targets, mask, v_min=V_MIN, v_max=V_MAX, num_tokens=num_tokens
    )
    whole.backward()
    parts_leaf = as_leaf(logits)
    parts = sum(
        distributional_value_loss(
            parts_leaf[rows], targets[rows], mask[rows], v_min=V_MIN, v_max=V_MAX,
            num_tokens=num_tokens,
        )[0]
        for rows in (slice(0, 2), slice(2, 3), slice(3, 6))
    )  # fmt: skip
    parts.backward()
    torch.testing.assert_close(parts, whole, atol=1e-6, rtol=0)
    torch.testing.assert_close(parts_leaf.grad, whole_leaf.grad, atol=1e-7, rtol=0)


def test_distributional_head_value_is_the_mean_of_the_atoms():
    head = DistributionalHead(atoms=ATOMS, v_min=V_MIN, v_max=V_MAX).build(8, torch.float32, 0)
    hidden = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        head.weight.mul_(40.0)  # far from uniform
        logits = head(hidden)
    assert logits.shape == (2, 3, ATOMS)
    assert logits.dtype == torch.float32
    z = _ref_atoms(V_MIN, V_MAX, ATOMS)
    expected = []
    for b in range(2):
        row = []
        for t in range(3):
            log_p = _ref_log_softmax(logits[b, t].tolist())
            row.append(sum(math.exp(lp) * zi for lp, zi in zip(log_p, z, strict=True)))
        expected.append(row)
    close(head.value(logits), expected)


def test_multi_head_value_is_the_gated_mix_of_the_heads_and_trains_gate_and_heads():
    H, heads = 6, 3
    head = MultiHead(heads=heads).build(H, torch.float32, seed=4)
    assert sorted(n for n, _ in head.named_parameters()) == [
        "gate.bias", "gate.weight", "heads.bias", "heads.weight"
    ]  # fmt: skip
    assert torch.count_nonzero(head.gate.weight) == 0  # starts as the heads' mean
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        head.gate.weight.copy_(torch.randn(heads, H, generator=gen))
        head.gate.bias.copy_(torch.randn(heads, generator=gen))
        head.heads.bias.copy_(torch.randn(heads, generator=gen))
    hidden = torch.randn(2, 4, H, generator=gen)
    outputs = head(hidden)
    assert outputs.shape == (2, 4, 1)
    w, b = head.heads.weight.tolist(), head.heads.bias.tolist()
    gw, gb = head.gate.weight.tolist(), head.gate.bias.tolist()
    expected = []
    for x in hidden.reshape(-1, H).tolist():
        v = [sum(wk * xk for wk, xk in zip(w[h], x, strict=True)) + b[h] for h in range(heads)]
        g = [sum(wk * xk for wk, xk in zip(gw[h], x, strict=True)) + gb[h] for h in range(heads)]
        p = [math.exp(lp) for lp in _ref_log_softmax(g)]
        expected.append(sum(ph * vh for ph, vh in zip(p, v, strict=True)))
    close(head.value(outputs).reshape(-1), expected)

    fresh = MultiHead(heads=heads).build(H, torch.float32, seed=4)
    values = fresh.value(fresh(hidden))
    targets = torch.randn(2, 4, generator=gen)
    loss, _ = value_loss(values, values.detach(), targets, torch.ones(2, 4), clip=0.5)
    loss.backward()
    for name, param in fresh.named_parameters():  # the zero gate still gets a gradient
        assert param.grad is not None, name
        assert torch.count_nonzero(param.grad) > 0, name


def _previous_scalar_head(hidden_size: int, dtype: torch.dtype, seed: int) -> nn.Linear:
    """The critic's head before head kinds: nn.Linear(H, 1), weight ~ N(0, (1/(H+1))²) from a
    generator seeded with `seed`, bias 0."""
    head = nn.Linear(hidden_size, 1, device="meta", dtype=dtype).to_empty(device="cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.normal_(0.0, 1.0 / (hidden_size + 1), generator=generator)
        head.bias.zero_()
    return head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scalar_head_is_bitwise_the_previous_head(dtype):
    before = _previous_scalar_head(16, dtype, seed=3)
    head = ScalarHead().build(16, dtype, seed=3)
    assert isinstance(head, nn.Linear)
    assert head.state_dict().keys() == before.state_dict().keys() == {"weight", "bias"}
    for name, value in before.state_dict().items():
        assert torch.equal(head.state_dict()[name], value), name
    assert not torch.equal(ScalarHead().build(16, dtype, seed=4).weight, before.weight)
    hidden = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    outputs = head(hidden)
    assert outputs.shape == (3, 5, 1)
    assert outputs.dtype == torch.float32
    assert torch.equal(head.value(outputs), before(hidden).squeeze(-1).float())


# -- configuration --------------------------------------------------------------------------


def _problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as excinfo:
        load_config(["vapo", "tiny-cpu"], overrides=list(overrides))
    return "\n".join(excinfo.value.problems)


def test_value_head_config_defaults_and_kinds():
    assert load_config(["vapo"]).algorithm.value_head == ScalarHead()
    assert load_config(["orz"]).algorithm.value_head == ScalarHead()
    config = load_config(
        ["vapo"], overrides=["algorithm.value_head.kind=multi_head", "algorithm.value_head.heads=3"]
    )
    assert config.algorithm.value_head == MultiHead(heads=3)
    config = load_config(["orz"], overrides=["algorithm.value_head={kind: distributional}"])
    assert config.algorithm.value_head == DistributionalHead(atoms=51, v_min=-1.0, v_max=1.0)


def test_value_head_config_errors_name_the_field_and_the_fix():
    text = _problems(
        "algorithm.value_head.kind=distributional",
        "algorithm.value_head.v_min=1.0",
        "algorithm.value_head.v_max=1.0",
    )
    assert "algorithm.value_head: v_min (1.0) must be below v_max (1.0)" in text
    text = _problems("algorithm.value_head.kind=multi_head", "algorithm.value_head.heads=1")
    assert "algorithm.value_head.heads: Input should be greater than or equal to 2" in text
    text = _problems("algorithm.value_head.kind=distributionl")
    assert "algorithm.value_head.kind: unknown algorithm.value_head 'distributionl'" in text
    assert "Did you mean 'distributional'?" in text
    text = _problems("algorithm.value_head.kind=distributional", "algorithm.value_head.atom=11")
    assert "algorithm.value_head.atom: unknown field" in text
    assert "Did you mean 'atoms'?" in text


def test_only_the_scalar_head_starts_from_a_reward_model():
    config = load_config(["vapo"], overrides=["model.critic.init_from=/models/rm"])
    assert critic_init(config.model, ScalarHead()) == "/models/rm"
    for head in (MultiHead(), DistributionalHead()):
        with pytest.raises(ValueError, match=r"model\.critic\.init_from='/models/rm'") as error:
            critic_init(config.model, head)
        assert f"algorithm.value_head.kind={head.kind}" in str(error.value)
        assert "set model.critic.init_from=policy" in str(error.value)
    assert critic_init(load_config(["vapo"]).model, DistributionalHead()) == "policy"
