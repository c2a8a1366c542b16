"""LoRA in the learner (`model.lora`), one process on the tiny model: the adapted policy built
the learner's way (meta device, sharded reads, FSDP2) trains exactly as a PEFT model trained by
hand; only adapters reach the optimiser; the reference is the base; what a version publishes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from streamrl.algorithms import grpo_advantages
from streamrl.config.loading import load_config
from streamrl.learner.forward import token_scores
from streamrl.learner.loading import build_step_models
from streamrl.learner.lora import initial_adapter, publish_shares
from streamrl.learner.mini_batches import TrainBatch, make_mini_batches
from streamrl.learner.step import StepSettings, train_on_batch
from streamrl.learner.topology import Topology
from streamrl.models import resolve_model_path
from streamrl.models.lora import merged_weights, peft_name
from tests.stream_data import random_group

MAX_TOKENS = 16
SETTINGS = StepSettings(temperature=1.0, max_response_len=MAX_TOKENS, grad_clip=1.0)


@pytest.fixture(scope="module")
def topology():
    topo = Topology.from_env("cpu")
    yield topo
    topo.destroy()


def _whole(param: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value (FSDP2 parameters are DTensors, even on one rank)."""
    param = param.detach()
    return param.full_tensor() if isinstance(param, DTensor) else param


def _unwrapped(name: str) -> str:
    """A parameter's name without activation checkpointing's wrapper."""
    return name.replace("_checkpoint_wrapped_module.", "")


def _config(*overrides: str):
    return load_config(
        ["dapo", "tiny-cpu"],
        overrides=[
            f"generator.max_tokens={MAX_TOKENS}",
            "model.lora.rank=4",
            "model.lora.alpha=8",
            "learner.lr=1e-2",
            "learner.weight_decay=0.1",
            "algorithm.correction.method=none",
            *overrides,
        ],
    )


def _groups(vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    groups = [
        random_group(rng, prompt_id=f"p{i}", vocab=vocab, max_len=MAX_TOKENS - 1, prompt_len=6)
        for i in range(3)
    ]
    for group in groups:  # mixed rewards in every group: each carries a gradient
        group.rewards[:2], group.raw_scores[:2] = [1.0, -1.0], [1.0, 0.0]
    return groups


def _peft_model(path: str, config, adapter: dict[str, torch.Tensor]):
    """A plain PEFT model of the same adapter, its A and B set to `adapter` (learner names)."""
    from peft import get_peft_model

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = get_peft_model(base, config.model.lora.peft_config())
    own = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in adapter.items():
            own[f"base_model.model.{name}"].copy_(value)
    return model


def _hand_written_step(model, groups, config) -> None:
    """One DAPO update (one mini-batch: ratio 1, token-mean over every loss token, no
    correction) written out: log-probs of each response by a plain forward, −A·ratio summed
    over tokens and divided by the batch's token count, global-norm clipping, AdamW."""
    lcfg = config.learner
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=lcfg.lr, betas=lcfg.betas, eps=lcfg.eps, weight_decay=lcfg.weight_decay
    )
    rewards = torch.tensor(np.concatenate([g.rewards for g in groups]))
    index = torch.repeat_interleave(torch.arange(len(groups)), torch.tensor([4] * len(groups)))
    advantages = grpo_advantages(rewards, index, len(groups))
    terms, tokens, i = [], 0, 0
    for group in groups:
        for response in group.response_tokens:
            ids = torch.tensor([[*group.prompt_tokens.tolist(), *response.tolist()]])
            logits = model(input_ids=ids).logits[0, len(group.prompt_tokens) - 1 : -1]
            logp = torch.log_softmax(logits.float(), -1).gather(
                -1, torch.as_tensor(response).long()[:, None]
            )[:, 0]
            terms.append((-advantages[i] * torch.exp(logp - logp.detach())).sum())
            tokens += len(response)
            i += 1
    loss = torch.stack(terms).sum() / tokens
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, SETTINGS.grad_clip)
    optimizer.step()


@pytest.mark.parametrize(
    "paths",
    [
        (),  # shared-prompt rows (sdpa), the LM head on response positions only
        ("learner.activation_checkpointing=true", "learner.shared_prompt='off'"),
    ],
)
def test_a_lora_step_equals_a_hand_written_peft_step(topology, paths):
    config = _config(*paths)
    models, _ = build_step_models(config, topology)
    policy = models.policy.model
    groups = _groups(policy.config.vocab_size)
    start = {n: _whole(p).clone() for n, p in policy.named_parameters()}
    assert {n for n in start if ".lora_" in n} == set(initial_adapter(policy, 0))
    adapter = {_unwrapped(n): v for n, v in start.items() if ".lora_" in n}
    reference = _peft_model(resolve_model_path("tiny-qwen2"), config, adapter)

    batch = TrainBatch.from_groups(groups)
    minis = make_mini_batches(batch, batch.num_groups, 4096)
    train_on_batch(models, batch, minis, config.algorithm, SETTINGS, topology)
    _hand_written_step(reference, groups, config)

    expected = {n.removeprefix("base_model.model."): p for n, p in reference.named_parameters()}
    for wrapped, param in policy.named_parameters():
        name = _unwrapped(wrapped)
        theirs = expected[name.replace("lm_head.weight", "model.embed_tokens.weight")]
        if ".lora_" in name:
            # Adam's first step is ±lr where |g| ≫ eps: 1e-5 is a thousandth of a step
            torch.testing.assert_close(_whole(param), theirs.detach(), atol=1e-5, rtol=0)
            assert not torch.equal(_whole(param), start[wrapped]), f"{name} did not move"
        else:  # the base is frozen and equals the checkpoint's
            assert torch.equal(_whole(param), start[wrapped]), name
            assert torch.equal(_whole(param), theirs.detach()), name


def test_only_adapters_are_optimised(topology):
    config = _config()
    models, _ = build_step_models(config, topology)
    optimizer = models.policy.optimizer
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    names = {n for n, p in models.policy.model.named_parameters() if id(p) in held}
    layers = models.policy.model.config.num_hidden_layers
    assert all(".lora_A." in n or ".lora_B." in n for n in names)
    assert len(names) == 2 * len(config.model.lora.target_modules) * layers
    batch = TrainBatch.from_groups(_groups(models.policy.model.config.vocab_size))
    minis = make_mini_batches(batch, batch.num_groups, 4096)
    train_on_batch(models, batch, minis, config.algorithm, SETTINGS, topology)
    assert {id(p) for p in optimizer.state} == held  # moments of the adapters only


def test_the_reference_is_the_base_model(topology):
    """With a KL term the reference log-probs are the base model's, after the adapters moved;
    the policy's are not."""
    config = _config("algorithm.kl.coef=0.01", "algorithm.kl.placement=loss")
    models, _ = build_step_models(config, topology)
    policy = models.policy.model
    batch = TrainBatch.from_groups(_groups(policy.config.vocab_size, seed=1))
    minis = make_mini_batches(batch, batch.num_groups, 4096)
    first = train_on_batch(models, batch, minis, config.algorithm, SETTINGS, topology)
    second = train_on_batch(models, batch, minis, config.algorithm, SETTINGS, topology)
    # B starts at 0: the policy is the base until its first update, then moves away from it
    assert first["actor/kl_loss"] == pytest.approx(0.0, abs=1e-7)
    assert second["actor/kl_loss"] > 1e-6
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-qwen2")).eval()
    base.model.embed_tokens.weight.requires_grad_(False)
    (micro,) = minis[0].micro_batches
    with torch.no_grad():
        ref = token_scores(models.reference, micro)[0]
        now = token_scores(policy, micro)[0]
        logits = base(input_ids=micro.input_ids, position_ids=micro.position_ids,
                      attention_mask=micro.attention_mask).logits  # fmt: skip
    mask = micro.sampled_mask
    expected = torch.log_softmax(logits.float(), -1)
    rows = expected.reshape(-1, expected.shape[-1])[micro.gather[mask]]
    expected = rows.gather(-1, micro.targets[mask].long()[:, None])[:, 0]
    torch.testing.assert_close(ref[mask], expected, atol=1e-5, rtol=0)
    assert (now[mask] - expected).abs().max() > 1e-3  # the adapters changed the policy


def test_a_version_holds_the_adapter_or_the_merged_weights(topology):
    config = _config()
    models, _ = build_step_models(config, topology)
    policy = models.policy.model
    with torch.no_grad():  # adapters away from their start (B = 0 would merge to the base)
        for name, param in policy.named_parameters():
            if ".lora_B." in name:
                param.to_local().copy_(torch.randn(param.shape) * 0.1)
    lora = config.model.lora
    adapter = {n: t for n, (t, _, _) in publish_shares(lora, "adapter")(policy, True).items()}
    own = {n: _whole(p) for n, p in policy.named_parameters()}
    assert adapter.keys() == {peft_name(n) for n in own if ".lora_" in n}
    merged = {n: t for n, (t, _, _) in publish_shares(lora, "merged")(policy, True).items()}
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-qwen2")).state_dict()
    assert merged.keys() == base.keys()
    expected = merged_weights(base, adapter, lora)
    for name, value in merged.items():
        torch.testing.assert_close(value.reshape(expected[name].shape), expected[name])
    q = "model.layers.0.self_attn.q_proj"
    a, b = own[f"{q}.lora_A.default.weight"], own[f"{q}.lora_B.default.weight"]
    torch.testing.assert_close(
        merged[f"{q}.weight"].reshape(base[f"{q}.weight"].shape),
        base[f"{q}.weight"] + lora.scaling * b @ a,
    )
