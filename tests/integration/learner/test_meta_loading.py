"""The learner's models built on the meta device and filled by sharded reads
(`streamrl.learner.loading`, `streamrl.learner.meta`) equal the models loaded whole then sharded,
bit for bit, on one rank and on two gloo ranks: the tied tiny policy, an untied bf16 policy over two
safetensors files, the critic from the policy and from a reward model. Each of two ranks reads only
its own rows; a checkpoint without safetensors is loaded whole; a frozen reference is stored in the
compute dtype, an EMA one in float32."""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from streamrl.config.loading import load_config
from streamrl.learner.forward import use_hidden_states_head
from streamrl.learner.loading import build_step_models
from streamrl.learner.meta import load_sharded, meta_policy
from streamrl.learner.model import full_state_dict, load_policy, shard_model
from streamrl.learner.topology import Topology
from streamrl.models import resolve_model_path
from streamrl.models.config import ModelConfig
from tests.integration.learner import meta_loading_worker as worker
from tests.integration.torchrun import torchrun


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`split`: an untied Qwen2 (odd vocabulary: uneven shards) saved in bf16 over two
    safetensors files with an index; `rm`: a one-label reward model over tiny-qwen2's
    vocabulary; `bin`: the split model as pytorch_model.bin only."""
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(1)
    config = Qwen2Config(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    split = Qwen2ForCausalLM(config).to(torch.bfloat16)
    size = sum(p.numel() * p.element_size() for p in split.parameters())
    split.save_pretrained(root / "split", max_shard_size=size * 6 // 10)
    index = json.loads((root / "split" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    assert "lm_head.weight" in index["weight_map"]

    config.save_pretrained(root / "bin")
    torch.save(split.state_dict(), root / "bin" / "pytorch_model.bin")

    tiny = resolve_model_path("tiny-qwen2")  # built once, before two ranks race for it
    reward_model = AutoModelForSequenceClassification.from_config(
        AutoConfig.from_pretrained(tiny, num_labels=1)
    )
    reward_model.save_pretrained(root / "rm")
    return root


@pytest.fixture(scope="module")
def topology():
    topo = Topology.from_env("cpu")
    yield topo
    topo.destroy()


def _check(name: str, result: dict) -> None:
    assert result["mismatched"] in ([], None), f"{name}: {result['mismatched']}"
    assert result["buffers"], f"{name}: buffers differ"
    assert result["rotary"], f"{name}: no rotary inv_freq buffer compared"
    assert result["forward"], f"{name}: forward outputs differ"
    assert result["dtypes"] == ["torch.float32"], name


def test_one_rank_equals_loading_whole(models: Path, topology: Topology) -> None:
    for name, (kind, model_cfg) in worker.cases(models).items():
        result = worker.compare(kind, model_cfg, topology)
        assert result["mismatched"] == [], name
        _check(name, result)
        assert all(start == 0 and stop == rows for _, start, stop, rows in result["reads"])


def test_two_ranks_equal_loading_whole_and_each_reads_its_own_rows(
    models: Path, tmp_path: Path
) -> None:
    torchrun(worker.__file__, f"--models={models}", f"--out={tmp_path}")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0].keys() == set(worker.cases(models))
    for name in ranks[0]:
        _check(name, ranks[0][name])
        _check(name, ranks[1][name])
        assert ranks[1][name]["mismatched"] is None  # gathered on rank 0 only
        # Together the ranks read every row of each tensor once; neither read a whole one.
        spans: dict[str, list[tuple[int, int]]] = {}
        totals = {}
        for rank in ranks:
            for tensor, start, stop, rows in rank[name]["reads"]:
                assert start is not None, f"{name}: {tensor} read whole"
                spans.setdefault(tensor, []).append((start, stop))
                totals[tensor] = rows
        for tensor, parts in spans.items():
            parts.sort()
            assert parts[0][0] == 0, (name, tensor, parts)
            assert parts[-1][1] == totals[tensor], (name, tensor, parts)
            assert all(a[1] == b[0] for a, b in itertools.pairwise(parts)), (name, tensor, parts)


def test_checkpoint_without_safetensors_is_loaded_whole(
    models: Path, topology: Topology, caplog: pytest.LogCaptureFixture
) -> None:
    model_cfg = ModelConfig(path=str(models / "bin"))

    def shard(model: torch.nn.Module) -> torch.nn.Module:
        return shard_model(use_hidden_states_head(model), topology)

    with caplog.at_level(logging.WARNING, logger="streamrl.learner.meta"):
        loaded = load_sharded(meta_policy(model_cfg.path, model_cfg), shard, topology)
    assert "has no safetensors files" in caplog.text
    expected = full_state_dict(shard(load_policy(model_cfg.path, model_cfg)), topology)
    got = full_state_dict(loaded, topology)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], tensor) for name, tensor in expected.items())


@pytest.mark.parametrize(
    ("mixed_precision", "reference", "dtype"),
    [("bf16", "frozen", torch.bfloat16), ("bf16", "ema", torch.float32)],
)
def test_reference_dtype(
    topology: Topology, mixed_precision: str, reference: str, dtype: torch.dtype
) -> None:
    """A frozen reference is stored in the compute dtype (bf16 here, on CPU) and runs through
    FSDP2's mixed precision; an EMA one keeps float32 like the policy it follows."""
    config = load_config(
        ["grpo", "tiny-cpu"],
        overrides=[
            f"learner.mixed_precision={mixed_precision}",
            f"algorithm.kl.reference={reference}",
        ],
    )
    models, _ = build_step_models(config, topology)
    policy, ref = models.policy.model, models.reference
    assert {p.dtype for p in policy.parameters()} == {torch.float32}
    assert {p.dtype for p in ref.parameters()} == {dtype}
    assert not any(p.requires_grad for p in ref.parameters())
    policy_state, ref_state = full_state_dict(policy, topology), full_state_dict(ref, topology)
    for name, tensor in policy_state.items():
        assert torch.equal(ref_state[name], tensor.to(dtype)), name
    input_ids = torch.randint(0, policy.config.vocab_size, (2, 7))
    with torch.no_grad():
        hidden = ref(input_ids=input_ids).logits  # HiddenStatesHead: the final hidden states
    assert hidden.dtype == torch.bfloat16
    assert torch.isfinite(hidden.float()).all()
