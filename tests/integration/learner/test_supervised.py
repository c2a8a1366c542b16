"""Supervised fine-tuning on the tiny model, one process (`streamrl.learner.supervised`): the
step's loss is exactly the token-mean NLL of the assistant tokens (checked against a plain
forward pass of the model), it falls as the model learns the conversations, the held-out loss
is reported, every version is published, and a resumed run takes the same conversations next
and ends bit-identical to one that ran straight through."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from transformers import AutoTokenizer

from storage.checkpoints.dcp import CheckpointStore
from storage.fs import open_location
from storage.weights.versions import WeightStore
from streamrl.config.loading import load_config
from streamrl.data.rows import DatasetError
from streamrl.learner.loop import Learner
from streamrl.learner.model import load_policy
from streamrl.learner.supervised import SupervisedLearner, SupervisedSource
from streamrl.learner.topology import Topology
from streamrl.models import resolve_model_path


@pytest.fixture(scope="module")
def topology():
    topo = Topology.from_env("cpu")
    yield topo
    topo.destroy()


def _conversation(i: int) -> dict:
    a, b = i + 2, 3 * i + 1
    if i % 3:  # plain question and answer
        return {"messages": [
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": f"{a} + {b} = {a + b}."},
        ]}  # fmt: skip
    return {"messages": [  # with a call to the calculator and its answer
        {"role": "system", "content": "Use the calculator."},
        {"role": "user", "content": f"What is {a} * {b}?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "calculate", "arguments": json.dumps({"expression": f"{a} * {b}"})}}]},
        {"role": "tool", "name": "calculate", "content": str(a * b)},
        {"role": "assistant", "content": f"It is {a * b}."},
    ]}  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sft-data")
    for name, rows in (("train", range(10)), ("val", range(20, 23))):
        (folder / f"{name}.jsonl").write_text(
            "".join(json.dumps(_conversation(i)) + "\n" for i in rows)
        )
    return folder


def _config(run_dir, data, total_steps: int, *extra: str):
    return load_config(
        ["grpo", "tiny-cpu"],
        overrides=[
            "sft={eval_every: 2}",
            f"data.path={data / 'train.jsonl'}",
            f"data.val_path={data / 'val.jsonl'}",
            f"storage.run_uri={run_dir}",
            f"learner.total_steps={total_steps}",
            "learner.batch_groups=4",
            "learner.mini_batch_groups=2",
            "learner.micro_batch_tokens=256",  # several micro-batches a mini-batch
            "learner.checkpoint_every=2",
            "learner.lr=1e-3",
            *extra,
        ],
    )


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def test_the_step_loss_is_the_token_mean_nll_of_the_assistant_tokens(tmp_path, topology, data):
    config = _config(tmp_path / "run", data, 1, "learner.mini_batch_groups=4")  # one update
    learner = SupervisedLearner(config, open_location(str(tmp_path / "run")), topology)
    groups = learner.examples.batch(0, 4, 0)
    # The reference: the model as loaded, each whole conversation through a plain forward.
    model = load_policy("tiny-qwen2", config.model).eval()
    total, tokens = 0.0, 0
    for group in groups:
        ids = torch.cat([torch.as_tensor(group.prompt_tokens), torch.as_tensor(
            group.response_tokens[0])]).long()  # fmt: skip
        mask = torch.cat([torch.zeros(len(group.prompt_tokens)), torch.as_tensor(
            group.loss_masks[0]).float()])  # fmt: skip
        with torch.no_grad():
            logp = model(ids[None]).logits[0, :-1].float().log_softmax(-1)
        chosen = logp.gather(-1, ids[1:, None])[:, 0]
        total -= float((chosen * mask[1:]).sum())
        tokens += int(mask[1:].sum())
    metrics = learner.train_step()
    assert metrics["sft/tokens"] == tokens
    assert metrics["sft/loss"] == pytest.approx(total / tokens, rel=1e-5)
    assert metrics["sft/conversations"] == 4
    assert math.isfinite(metrics["actor/grad_norm"])
    learner.release()


def test_sft_learns_publishes_and_reports_the_heldout_loss(tmp_path, topology, data):
    run_dir = tmp_path / "run"
    run = open_location(str(run_dir))
    assert SupervisedLearner(_config(run_dir, data, 6), run, topology).run() == 6
    metrics = [json.loads(line) for line in (run_dir / "metrics" / "learner.jsonl").open()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    losses = [m["sft/loss"] for m in metrics]
    assert all(b < a for a, b in itertools.pairwise(losses)), losses  # it learns them
    assert losses[-1] < losses[0] - 0.5
    heldout = [m.get("sft/heldout_loss") for m in metrics]
    assert [h is not None for h in heldout] == [False, True, False, True, False, True]
    assert heldout[-1] < heldout[1]  # the same task, other numbers
    assert metrics[-1]["sft/epoch"] == pytest.approx(24 / 10)
    assert WeightStore(run).versions() == [4, 5, 6]  # a version a step; weights.keep_versions=3
    assert CheckpointStore(run).committed_steps() == [4, 6]


def test_a_resumed_sft_run_takes_the_same_conversations_and_ends_bit_identical(
    tmp_path, topology, data
):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    uninterrupted = SupervisedLearner(_config(straight, data, 4), open_location(str(straight)),
                                      topology)  # fmt: skip
    uninterrupted.run()
    SupervisedLearner(_config(resumed, data, 2), open_location(str(resumed)), topology).run()
    second = SupervisedLearner(_config(resumed, data, 4), open_location(str(resumed)), topology)
    assert (second.state.step, second.state.sft_position) == (2, 8)
    second.run()
    assert second.state.sft_position == uninterrupted.state.sft_position == 16
    for (name, a), (_, b) in zip(
        uninterrupted.models.policy.model.state_dict().items(),
        second.models.policy.model.state_dict().items(),
        strict=True,
    ):
        assert torch.equal(_full(a), _full(b)), name


def test_epochs_visit_every_conversation_once_in_a_seeded_order(data) -> None:
    config = _config("unused", data, 1)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny-qwen2"))
    source = SupervisedSource(config, tokenizer=tokenizer)
    epoch = [g.prompt_id for g in source.batch(0, 10, 0)]
    assert sorted(epoch) == sorted(source.train.ids)
    assert epoch != [f"train:{i}" for i in range(10)]  # shuffled
    again = SupervisedSource(config, tokenizer=tokenizer)
    assert [g.prompt_id for g in again.batch(3, 5, 0)] == epoch[3:8]  # a position resumes
    assert sorted(g.prompt_id for g in source.batch(10, 10, 0)) == sorted(source.train.ids)


def test_a_conversation_the_learner_cannot_use_is_refused_naming_the_row(tmp_path, data) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_conversation(1)) + "\n" + json.dumps({"messages": [
        {"role": "user", "content": "hi"}]}) + "\n")  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny-qwen2"))
    config = _config("unused", data, 1, f"data.path={bad}")
    with pytest.raises(DatasetError, match=r"row 1 \(0-based\) of .*bad.jsonl: the conversation "
                                           "has no assistant message"):  # fmt: skip
        SupervisedSource(config, tokenizer=tokenizer)
    config = _config("unused", data, 1, "sft.messages_field=conversation")
    with pytest.raises(DatasetError, match=r"no value at .conversation. \(sft.messages_field\)"):
        SupervisedSource(config, tokenizer=tokenizer)


def test_a_supervised_run_has_no_generator_reference_or_critic(tmp_path, topology, data) -> None:
    # The algorithm section is not used: even one with a KL term builds the policy alone.
    config = _config(tmp_path / "run", data, 1)
    assert config.algorithm.reference_kl is not None  # grpo's KL
    learner = SupervisedLearner(config, open_location(str(tmp_path / "run")), topology)
    assert (learner.models.reference, learner.models.critic, learner.stream) == (None,) * 3
    learner.release()
    assert issubclass(SupervisedLearner, Learner)


def test_sft_trains_lora_adapters_on_the_frozen_base(tmp_path, topology, data) -> None:
    run_dir = tmp_path / "run"
    run = open_location(str(run_dir))
    lora = ("model.lora.rank=4", "model.lora.alpha=8", "learner.lr=1e-2")
    learner = SupervisedLearner(_config(run_dir, data, 3, *lora), run, topology)
    base = {n: _full(p).clone() for n, p in learner.models.policy.model.named_parameters()
            if "lora_" not in n}  # fmt: skip
    learner.run()
    metrics = [json.loads(line) for line in (run_dir / "metrics" / "learner.jsonl").open()]
    assert metrics[-1]["sft/loss"] < metrics[0]["sft/loss"]
    for name, param in learner.models.policy.model.named_parameters():
        if "lora_" not in name:
            assert torch.equal(_full(param), base[name]), name  # the base never moves
    _, manifest = WeightStore(run).load(3)
    assert "lora_adapter" in manifest.model_config  # an adapter version
