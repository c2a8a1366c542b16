"""GPUs shared by the learner and engines: who lands where, each one's planned share of the
memory, and refusals that name the numbers — on fake machines (GPU sizes and the model's shape
given to the planner), plus the model's shape read from a real config file."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from streamrl.config.loading import load_config
from streamrl.placement import PlacementError, plan_placement
from streamrl.placement.gpu_memory import (
    CONTEXT_RESERVE_GIB,
    GIB,
    LEARNER_HEADROOM,
    ModelShape,
    learner_need_bytes,
    model_shape,
)
from streamrl.placement.records import GPU_SHARE_VARIABLE, HANDOFF_VARIABLE

# Qwen2.5-0.5B's shape: 494M parameters, 24 layers of 896, 151936 tokens, 2 KV heads of 64.
HALF_B = ModelShape(
    parameters=494_032_768,
    hidden_size=896,
    layers=24,
    vocab_size=151_936,
    kv_bytes_per_token=2 * 24 * 2 * 64 * 2,
)
SEVEN_B = ModelShape(
    parameters=7_615_616_512,
    hidden_size=3584,
    layers=28,
    vocab_size=152_064,
    kv_bytes_per_token=2 * 28 * 4 * 128 * 2,
)
H100 = 80 * GIB


def config(*overrides: str):
    return load_config(overrides=["learner.device=cuda", "generator.device=cuda", *overrides])


def plan(cfg, gpus: int, generators: int = 1, model: ModelShape = HALF_B):
    names = [str(i) for i in range(gpus)]
    return plan_placement(
        cfg,
        generators=generators,
        cpus=range(16),
        gpus=names,
        gpu_memory=dict.fromkeys(names, H100),
        model=model,
    )


def test_one_gpu_holds_the_learner_and_the_generator_with_planned_shares():
    cfg = config()
    placed = plan(cfg, gpus=1)
    assert placed.learner.gpus == placed.generators[0].gpus == ("0",)
    learner, gen = placed.learner.gpu_memory_fraction, placed.generators[0].gpu_memory_fraction
    # The learner its need (with its two hand-off slots) plus a quarter; the generator what is
    # left after a context each.
    need = learner_need_bytes(cfg, HALF_B, handoff=True)
    assert need == learner_need_bytes(cfg, HALF_B) + 2 * HALF_B.parameters * 2  # bf16 versions
    assert learner == pytest.approx(LEARNER_HEADROOM * need / H100)
    assert learner + gen == pytest.approx(1 - 2 * CONTEXT_RESERVE_GIB * GIB / H100)
    assert placed.learner.env()[GPU_SHARE_VARIABLE] == f"{learner:.4f}"
    assert placed.generators[0].env()[GPU_SHARE_VARIABLE] == f"{gen:.4f}"
    header = placed.describe()
    assert f"GPU 0 (80 GiB) shared by learner {learner:.0%}, gen0 {gen:.0%}" in header
    # A GPU to itself: no share is set, nothing is said.
    alone = plan(cfg, gpus=2)
    assert (alone.learner.gpus, alone.generators[0].gpus) == (("0",), ("1",))
    assert alone.learner.gpu_memory_fraction is None
    assert GPU_SHARE_VARIABLE not in alone.generators[0].env()
    assert "shared by" not in alone.describe()


def test_share_gpus_true_puts_the_engines_on_the_learners_gpus():
    placed = plan(config("placement.share_gpus=true", "eval.every_versions=1"), gpus=4)
    assert [p.gpus for p in placed.processes] == [("0",), ("0",), ("0",)]
    assert len([p for p in placed.processes if p.gpu_memory_fraction]) == 3


def test_engines_take_the_least_used_gpus_first():
    cfg = config("learner.nproc_per_node=2")
    placed = plan(cfg, gpus=3, generators=3)
    assert placed.learner.gpus == ("0", "1")
    assert [g.gpus for g in placed.generators] == [("2",), ("0",), ("1",)]
    assert placed.generators[0].gpu_memory_fraction is None  # GPU 2 is its own


def test_share_gpus_false_refuses_with_the_numbers():
    message = "1 generators × 1 GPU + learner 1 GPUs = 2 GPUs, this machine has 1"
    with pytest.raises(PlacementError, match=re.escape(message)) as refused:
        plan(config("placement.share_gpus=false"), gpus=1)
    assert "placement.share_gpus" in str(refused.value)


def test_a_learner_that_cannot_fit_beside_the_generator_is_refused_naming_what_to_change():
    with pytest.raises(PlacementError) as refused:
        plan(config(), gpus=1, model=SEVEN_B)
    message = str(refused.value)
    assert "GPU 0 (80.0 GiB, 78.5 GiB after a CUDA context per process) cannot hold" in message
    assert re.search(r"learner 1\d\d\.\d GiB \(needs ≥ 1\d\d\.\d GiB\)", message)
    assert "learner.activation_checkpointing" in message
    assert "model.lora" in message


def test_explicit_shares_that_add_up_to_more_than_the_gpu_are_refused():
    cfg = config("generator.gpu_memory_utilization=0.6", "learner.gpu_memory_fraction=0.5")
    with pytest.raises(
        PlacementError, match=r"learner 40\.0 GiB .*, gen0 48\.0 GiB .*88\.0 GiB in all"
    ):
        plan(cfg, gpus=1)
    fits = plan(
        config("generator.gpu_memory_utilization=0.5", "learner.gpu_memory_fraction=0.4"), 1
    )
    assert (fits.learner.gpu_memory_fraction, fits.generators[0].gpu_memory_fraction) == (0.4, 0.5)


def test_a_generator_asking_less_than_its_weights_is_refused():
    cfg = config("generator.gpu_memory_utilization=0.01")  # 0.8 GiB for 0.9 GiB of bf16 weights
    with pytest.raises(PlacementError, match=r"gen0 0\.8 GiB \(needs ≥ 0\.9 GiB\)"):
        plan(cfg, gpus=1)


def test_the_model_shape_is_read_from_its_config_without_loading_weights(tmp_path):
    shape = Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
    )
    shape.save_pretrained(tmp_path)
    with torch.device("meta"):
        counted = sum(p.numel() for p in AutoModelForCausalLM.from_config(shape).parameters())
    read = model_shape(load_config(overrides=[f"model.path={tmp_path}"]))
    assert read == ModelShape(
        parameters=counted,
        hidden_size=64,
        layers=3,
        vocab_size=1000,
        kv_bytes_per_token=2 * 3 * 2 * 16 * 2,  # keys and values, 3 layers, 2 heads of 16, bf16
    )


def test_generators_on_the_learners_gpu_take_its_weights_from_memory():
    placed = plan(config(), gpus=2, generators=2)  # gen0 on GPU 1 alone, gen1 beside the learner
    assert [g.gpus for g in placed.generators] == [("1",), ("0",)]
    assert [g.handoff for g in placed.generators] == [False, True]
    assert placed.learner.handoff
    assert placed.learner.env()[HANDOFF_VARIABLE] == "1"
    assert placed.generators[1].env()[HANDOFF_VARIABLE] == "1"
    assert HANDOFF_VARIABLE not in placed.generators[0].env()
    assert "weight versions go from the learner to gen1 from its GPU memory" in placed.describe()

    # Turned off, or LoRA adapters (loaded by vLLM's adapter path): storage only, no slots.
    for off in (config("weights.handoff=false"), config("model.lora.rank=8")):
        placed = plan(off, gpus=1)
        assert not placed.learner.handoff
        assert not placed.generators[0].handoff
        assert "weight versions go" not in placed.describe()
    merged = plan(config("model.lora.rank=8", "weights.lora_publish=merged"), gpus=1)
    assert merged.generators[0].handoff


def test_handoff_true_reaches_generators_that_do_not_share_a_gpu():
    on_cpu = load_config(overrides=["weights.handoff=true"])
    placed = plan_placement(on_cpu, generators=2, cpus=range(4), gpus=[])
    assert placed.learner.handoff
    assert all(g.handoff for g in placed.generators)
    assert placed.evaluator is None or not placed.evaluator.handoff  # it reads exact versions
    assert "gen0, gen1 from its host memory (shared memory)" in placed.describe()
    assert not plan_placement(load_config(), generators=1, cpus=range(4), gpus=[]).learner.handoff
