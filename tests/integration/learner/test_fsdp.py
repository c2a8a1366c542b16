"""The learner's model side on real processes: a two-rank gloo FSDP2 job on the tiny model
matches one unsharded process step for step; the gathered state dict is a loadable HF
checkpoint; schedule, clipping, critic and topology against references written here."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2ForSequenceClassification

from streamrl.learner.model import load_policy, load_value_model
from streamrl.learner.optim import build_optimizer, build_scheduler, clip_grad_norm
from streamrl.learner.topology import Topology, TopologyError
from streamrl.models import resolve_model_path
from streamrl.models.config import CriticConfig, ModelConfig
from tests.integration.learner import fsdp_worker as worker
from tests.integration.torchrun import torchrun

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The worker's outputs from one `torchrun --nproc_per_node 2` job."""
    out = tmp_path_factory.mktemp("fsdp")
    resolve_model_path(worker.MODEL)  # build the bundled model once, before two ranks race
    torchrun(worker.__file__, f"--out={out}")
    return out


def _unsharded_reference() -> tuple[dict[str, list[float]], torch.nn.Module]:
    """The worker's training loop in this process, one rank, no FSDP, the full batch, and
    torch's own clip_grad_norm_."""
    policy = load_policy(worker.MODEL, worker.MODEL_CFG)
    input_ids, attention_mask, loss_mask = worker.fixed_batch(policy.config.vocab_size)
    optimizer = build_optimizer(policy.parameters(), **worker.OPTIM)
    scheduler = build_scheduler(optimizer, **worker.SCHEDULE)
    record: dict[str, list[float]] = {"loss": [], "grad_norm": []}
    for _ in range(worker.STEPS):
        loss = worker.summed_token_nll(policy, input_ids, attention_mask, loss_mask) / (
            loss_mask[:, 1:].sum()
        )
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), worker.MAX_NORM)
        record["grad_norm"].append(norm.item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        record["loss"].append(loss.item())
    return record, policy


def test_two_rank_fsdp_matches_one_unsharded_process(two_rank_run: Path) -> None:
    """Losses, clipped gradient norms and updated parameters after 2 AdamW steps agree to
    1e-5; the state dict gathered on rank 0 loads strictly into a fresh HF model."""
    ranks = [json.loads((two_rank_run / f"rank{r}.json").read_text()) for r in (0, 1)]
    reference, policy = _unsharded_reference()
    for got in ranks:
        assert got["tied"], "lm_head and embed_tokens must stay one parameter after sharding"
        assert got["loss"] == pytest.approx(reference["loss"], abs=TOLERANCE, rel=0)
        assert got["grad_norm"] == pytest.approx(reference["grad_norm"], abs=TOLERANCE, rel=0)
        assert reference["grad_norm"][0] > worker.MAX_NORM  # clipping really acted
        lr = worker.OPTIM["lr"]
        assert got["lr"] == pytest.approx([lr, lr * worker.SCHEDULE["min_lr_ratio"]])

    state = torch.load(two_rank_run / "state.pt")
    expected = policy.state_dict()
    assert list(state) == list(expected)  # HF names, no FSDP or checkpoint-wrapper prefixes
    for name, tensor in expected.items():
        assert state[name].device.type == "cpu"
        assert state[name].dtype == torch.float32
        torch.testing.assert_close(state[name], tensor, atol=TOLERANCE, rtol=0, msg=name)
    fresh = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(policy.name_or_path))
    fresh.load_state_dict(state, strict=True)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    torch.testing.assert_close(
        fresh.lm_head.weight, expected["lm_head.weight"], atol=TOLERANCE, rtol=0
    )

    critic = load_value_model(worker.MODEL, worker.MODEL_CFG, seed=0)
    input_ids, attention_mask, _ = worker.fixed_batch(policy.config.vocab_size)
    with torch.no_grad():
        values = critic(input_ids, attention_mask=attention_mask)
    sharded_values = torch.tensor(ranks[0]["values"] + ranks[1]["values"])
    torch.testing.assert_close(sharded_values, values, atol=TOLERANCE, rtol=0)


def test_schedule_warms_up_then_follows_the_cosine_to_the_floor() -> None:
    peak, warmup, total, floor = 0.5, 3, 11, 0.2
    parameter = torch.nn.Parameter(torch.zeros(2, 2))
    optimizer = build_optimizer([parameter], lr=peak, weight_decay=0.0)
    scheduler = build_scheduler(optimizer, warmup, total, "cosine", floor)
    used = []
    for _ in range(total + 2):
        used.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected = []
    for update in range(1, total + 3):  # the lr of update 1, 2, ...
        if update <= warmup:
            expected.append(peak * update / warmup)
        else:
            t = min(update - warmup, total - warmup) / (total - warmup)
            expected.append(peak * (floor + (1 - floor) * (1 + math.cos(math.pi * t)) / 2))
    assert used == pytest.approx(expected, rel=1e-12)
    assert used[warmup - 1] == pytest.approx(peak)
    assert used[total - 1] == pytest.approx(peak * floor)

    constant = build_scheduler(build_optimizer([parameter], lr=peak, weight_decay=0.0), 0, 5)
    assert constant.get_last_lr() == [peak, peak]
    with pytest.raises(ValueError, match=r"warmup_steps \(6\) exceeds learner.total_steps"):
        build_scheduler(optimizer, 6, 5)


def test_weight_decay_skips_biases_and_norms() -> None:
    policy = load_policy(worker.MODEL, worker.MODEL_CFG)
    decayed, plain = build_optimizer(policy.parameters(), lr=1.0, weight_decay=0.1).param_groups
    assert (decayed["weight_decay"], plain["weight_decay"]) == (0.1, 0.0)
    names = {id(p): n for n, p in policy.named_parameters()}
    assert {names[id(p)] for p in plain["params"]} == {
        n for n, p in policy.named_parameters() if n.endswith(("bias", "norm.weight"))
    }
    assert len(decayed["params"]) + len(plain["params"]) == len(list(policy.parameters()))


def test_clip_grad_norm_equals_torch_on_a_copy() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    model(torch.randn(4, 5)).square().sum().backward()
    twin = copy.deepcopy(model)
    grads = [p.grad.clone() for p in model.parameters()]
    for twin_param, grad in zip(twin.parameters(), grads, strict=True):
        twin_param.grad = grad.clone()

    assert clip_grad_norm(model, None) == pytest.approx(torch.nn.utils.get_total_norm(grads).item())
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    norm = clip_grad_norm(model, 0.1)
    assert norm == torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.1).item() > 0.1
    for ours, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(ours.grad, theirs.grad)


def test_value_model_from_policy_and_from_a_reward_model(tmp_path: Path) -> None:
    policy = load_policy(worker.MODEL, worker.MODEL_CFG)
    critic = load_value_model(worker.MODEL, worker.MODEL_CFG, seed=3)
    backbone = critic.backbone.state_dict()
    assert backbone.keys() == policy.model.state_dict().keys()
    for name, tensor in policy.model.state_dict().items():
        assert torch.equal(backbone[name], tensor), name
    again = load_value_model(worker.MODEL, worker.MODEL_CFG, seed=3)
    assert torch.equal(again.value_head.weight, critic.value_head.weight)  # same on every rank
    input_ids = torch.randint(0, policy.config.vocab_size, (3, 5))
    values = critic(input_ids)
    assert values.shape == (3, 5)
    assert values.dtype == torch.float32

    reward_model = Qwen2ForSequenceClassification(
        AutoConfig.from_pretrained(policy.name_or_path, num_labels=1)
    )
    reward_model.save_pretrained(tmp_path / "rm")
    cfg = ModelConfig(path=worker.MODEL, critic=CriticConfig(init_from=str(tmp_path / "rm")))
    from_rm = load_value_model(worker.MODEL, cfg)
    torch.testing.assert_close(from_rm.value_head.weight, reward_model.score.weight)
    assert torch.equal(from_rm.value_head.bias, torch.zeros(1))
    torch.testing.assert_close(
        from_rm.backbone.state_dict(), reward_model.model.state_dict(), atol=0, rtol=0
    )
    not_rm = ModelConfig(path=worker.MODEL, critic=CriticConfig(init_from=policy.name_or_path))
    with pytest.raises(ValueError, match="is not a one-label reward model"):
        load_value_model(worker.MODEL, not_rm)


def test_single_process_topology(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    # An in-process vLLM engine (other tests) may already hold a one-rank group: the topology
    # then reuses it and must leave it alone on exit.
    already = torch.distributed.is_initialized()
    with Topology.from_env("cpu") as topology:
        assert topology.owns_process_group is not already
        assert (topology.rank, topology.world_size, topology.local_rank) == (0, 1, 0)
        assert topology.is_main
        assert topology.backend == "gloo"
        assert topology.device == torch.device("cpu")
        assert topology.mesh.size() == 1
        assert torch.distributed.is_initialized()
        assert torch.equal(topology.all_reduce_sum(torch.ones(3)), torch.ones(3))
        assert topology.broadcast_object({"a": 1}) == {"a": 1}
        assert topology.main_only(lambda: 5) == 5
        assert topology.decide_on_main(lambda: 6) == 6
        topology.barrier()
    assert torch.distributed.is_initialized() == already

    if not torch.cuda.is_available():
        with pytest.raises(TopologyError, match=r"set learner\.device=cpu or auto"):
            Topology.from_env("cuda")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(TopologyError, match="launch the learner with torchrun"):
        Topology.from_env("cpu")
