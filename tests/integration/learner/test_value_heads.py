"""The critic's value heads on the tiny model, one process: the scalar head's loss through the
head outputs is bitwise the loss on V as before; each head's critic built on the meta device and
read from the checkpoint is bitwise the one loaded whole; the multi-head and distributional
critics learn in value pre-training, leave every update unchanged by the micro-batch budget,
and train a short VAPO run whose checkpoint resumes with the critic's head restored."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from storage.fs import open_location
from storage.stream.writer import StreamWriter
from streamrl.algorithms.losses import value_loss
from streamrl.config.loading import load_config
from streamrl.learner.forward import values
from streamrl.learner.loop import Learner
from streamrl.learner.meta import load_sharded, meta_value_model
from streamrl.learner.mini_batches import TrainBatch, make_mini_batches
from streamrl.learner.model import full_state_dict, load_policy, load_value_model, shard_model
from streamrl.learner.objective import critic_loss
from streamrl.learner.scoring import score_batch
from streamrl.learner.step import StepModels, StepSettings, Trainable, train_on_batch
from streamrl.learner.topology import Topology
from tests.stream_data import random_group

MAX_TOKENS = 24
SETTINGS = StepSettings(temperature=1.0, max_response_len=MAX_TOKENS, grad_clip=None)
HEADS = {
    "multi_head": ("algorithm.value_head.kind=multi_head", "algorithm.value_head.heads=3"),
    "distributional": (
        "algorithm.value_head.kind=distributional",
        "algorithm.value_head.atoms=21",
        "algorithm.value_head.v_min=-1.5",
        "algorithm.value_head.v_max=1.5",
    ),
}


@pytest.fixture(scope="module")
def topology():
    topo = Topology.from_env("cpu")
    yield topo
    topo.destroy()


def _config(*overrides: str, run_dir=None):
    run = [f"storage.run_uri={run_dir}"] if run_dir is not None else []
    return load_config(
        ["vapo", "tiny-cpu"], overrides=[f"generator.max_tokens={MAX_TOKENS}", *run, *overrides]
    )


def _batch(vocab: int, seed: int = 0) -> TrainBatch:
    rng = np.random.default_rng(seed)
    made = []
    for i in range(4):
        group = random_group(rng, prompt_id=f"p{i}", vocab=vocab, max_len=MAX_TOKENS, prompt_len=10)
        group.raw_scores[:] = (group.rewards > 0).astype(np.float32)
        made.append(group)
    return TrainBatch.from_groups(made)


def _models(config, *, lr: float | None = None) -> StepModels:
    """Policy and critic (with the configured head); SGD at lr 1 (Δθ = −gradient) unless `lr`
    is given (AdamW)."""

    def optimizer(model):
        if lr is None:
            return torch.optim.SGD(model.parameters(), lr=1.0)
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    torch.manual_seed(0)
    policy = load_policy("tiny-qwen2", config.model)
    critic = load_value_model("tiny-qwen2", config.model, seed=0, head=config.algorithm.value_head)
    return StepModels(Trainable(policy, optimizer(policy)), Trainable(critic, optimizer(critic)))


def test_the_scalar_critic_loss_is_bitwise_the_value_loss_on_v(topology):
    """Through the head's outputs `[n, T−1, 1]`, the scalar critic's loss and gradient are
    exactly those of the clipped value loss on `values(critic, micro)`."""
    config = _config()
    models = _models(config)
    critic = models.critic.model
    batch = _batch(models.policy.model.config.vocab_size)
    (mini,) = make_mini_batches(batch, batch.num_groups, 4096)
    (micro,) = mini.micro_batches
    responses = batch.responses([mini])
    ((target,),), _ = score_batch(
        models, responses, [[micro]], config.algorithm, SETTINGS, topology, proximal=False
    )
    loss, metrics, _ = critic_loss(critic, micro, mini, target, config.algorithm)
    loss.backward()
    grads = [p.grad.clone() for p in critic.parameters()]
    critic.zero_grad()
    reference, _ = value_loss(
        values(critic, micro), target.old_values, target.value_targets, micro.loss_mask,
        clip=config.algorithm.value_clip, num_tokens=mini.num_loss_tokens,
    )  # fmt: skip
    reference.backward()
    assert torch.equal(loss, reference)
    for grad, param in zip(grads, critic.parameters(), strict=True):
        assert torch.equal(grad, param.grad)
    assert "critic/vf_clip_frac" in metrics


@pytest.mark.parametrize("head", ["scalar", *sorted(HEADS)])
def test_the_meta_built_critic_is_the_critic_loaded_whole(topology, head):
    """The learner's critic (`meta_value_model`, its fresh head drawn from the seed) equals
    `load_value_model`'s, parameters and outputs, bitwise."""
    config = _config(*HEADS.get(head, ()))
    value_head = config.algorithm.value_head
    assert value_head.kind == head

    def shard(model):
        return shard_model(model, topology)

    whole = shard(load_value_model("tiny-qwen2", config.model, seed=3, head=value_head))
    meta = meta_value_model("tiny-qwen2", config.model, seed=3, head=value_head)
    assert set(meta.fresh) == {n for n, _ in whole.named_parameters() if "value_head." in n}
    read = load_sharded(meta, shard, topology)
    expected, got = full_state_dict(whole, topology), full_state_dict(read, topology)
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        assert torch.equal(value, got[name]), name
    input_ids = torch.randint(0, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for outputs in (False, True):
            a, b = (m(input_ids=input_ids, outputs=outputs) for m in (whole, read))
            assert torch.equal(a, b)


@pytest.mark.parametrize("head", sorted(HEADS))
def test_a_head_learns_in_value_pretraining(topology, head):
    config = _config(*HEADS[head])
    models = _models(config, lr=1e-3)
    batch = _batch(models.policy.model.config.vocab_size, seed=5)
    minis = make_mini_batches(batch, 4, 4096)
    history = [
        train_on_batch(
            models, batch, minis, config.algorithm, SETTINGS, topology, train_policy=False
        )
        for _ in range(15)
    ]
    loss = [h["critic/vf_loss"] for h in history]
    ev = [h["critic/explained_var"] for h in history]
    print(f"{head}: loss {loss[0]:.4f} → {loss[-1]:.4f}; explained var {ev[0]:.3f} → {ev[-1]:.3f}")
    assert loss[-1] < loss[0]
    assert ev[-1] > ev[0] + 0.3


@pytest.mark.parametrize("head", sorted(HEADS))
def test_micro_batch_budget_leaves_the_update_unchanged(topology, head):
    """SGD at lr 1: the update is the gradient, which must not depend on how the batch is cut
    (the head's loss divides by the mini-batch's global token count)."""
    config = _config(*HEADS[head])
    updates, metrics = [], []
    for budget in (4096, 80):
        models = _models(config)
        batch = _batch(models.policy.model.config.vocab_size)
        minis = make_mini_batches(batch, batch.num_groups, budget)
        if budget == 80:
            assert len(minis[0].micro_batches) > 3
        before = [p.detach().clone() for p in models.critic.model.parameters()]
        metrics.append(train_on_batch(models, batch, minis, config.algorithm, SETTINGS, topology))
        after = [p.detach() for p in models.critic.model.parameters()]
        updates.append([a - b for a, b in zip(after, before, strict=True)])
    for whole, split in zip(*updates, strict=True):
        torch.testing.assert_close(whole, split, atol=1e-6, rtol=0)
    for name in ("critic/vf_loss", "critic/explained_var"):
        assert metrics[0][name] == pytest.approx(metrics[1][name], abs=1e-6), name


def _write_stream(run_dir, groups: int = 30) -> None:
    rng = np.random.default_rng(0)
    writer = StreamWriter(open_location(str(run_dir)), "gen0")
    made = [
        random_group(rng, prompt_id=f"p{i}", vocab=600, max_len=MAX_TOKENS, prompt_len=10)
        for i in range(groups)
    ]
    for start in range(0, groups, 5):
        writer.write(made[start : start + 5])


@pytest.mark.parametrize("head", sorted(HEADS))
def test_a_vapo_run_with_the_head_trains_and_resumes_from_its_checkpoint(tmp_path, topology, head):
    run_dir = tmp_path / "run"
    _write_stream(run_dir)
    run = open_location(str(run_dir))

    def learner(total_steps: int) -> Learner:
        config = _config(
            *HEADS[head],
            f"learner.total_steps={total_steps}",
            "learner.batch_groups=4",
            "learner.mini_batch_groups=2",
            "learner.checkpoint_every=2",
            "learner.max_staleness=100",  # the written stream is all version 0
            "algorithm.value_pretrain_steps=1",
            run_dir=run_dir,
        )
        return Learner(config, run, topology)

    first = learner(2)
    assert first.run() == 2
    critic = {k: v.detach().clone() for k, v in first.models.critic.model.state_dict().items()}
    assert any(k.startswith("value_head.") for k in critic)
    first.release()

    resumed = learner(3)
    assert resumed.state.step == 2
    restored = resumed.models.critic.model.state_dict()
    assert restored.keys() == critic.keys()
    for name, value in critic.items():
        assert torch.equal(restored[name], value), name
    assert resumed.run() == 3

    records = [json.loads(x) for x in (run_dir / "metrics/learner.jsonl").read_text().splitlines()]
    assert [r.get("value_pretrain_step") for r in records] == [1, None, None, None]
    for record in records:
        for name in ("critic/vf_loss", "critic/explained_var", "critic/grad_norm"):
            assert np.isfinite(record[name]), (name, record)
    assert [r["step"] for r in records[1:]] == [1, 2, 3]
    assert all(np.isfinite(r["actor/pg_loss"]) for r in records[1:])
