"""`model.lora`: its rules, PEFT's names, merging an adapter into its base (against a loop over
output rows) and the adapter directory PEFT loads."""

from __future__ import annotations

import pytest
import torch

from streamrl.config.loading import ConfigError, load_config
from streamrl.models.lora import (
    LoraConfig,
    adapter_files,
    base_weight_name,
    merged_weights,
    peft_name,
    vllm_max_lora_rank,
)


def test_an_ema_reference_is_refused_with_lora():
    with pytest.raises(ConfigError, match=r"reference=ema"):
        load_config(["t1", "tiny-cpu"], overrides=["model.lora.rank=8"])
    config = load_config(["grpo", "tiny-cpu"], overrides=["model.lora.rank=8"])  # frozen: fine
    assert config.served_adapter == config.model.lora


def test_embeddings_and_the_lm_head_are_not_targets():
    with pytest.raises(ConfigError, match=r"not LoRA targets"):
        load_config(["dapo", "tiny-cpu"], overrides=["model.lora.target_modules=[q_proj,lm_head]"])


def test_merged_publishing_serves_whole_models():
    config = load_config(
        ["dapo", "tiny-cpu"], overrides=["model.lora.rank=8", "weights.lora_publish=merged"]
    )
    assert config.served_adapter is None
    assert load_config(["dapo", "tiny-cpu"]).served_adapter is None


def test_names_between_the_learner_peft_and_the_base():
    learner = "model.layers.3.mlp.up_proj.lora_B.default.weight"
    assert peft_name(learner) == "base_model.model.model.layers.3.mlp.up_proj.lora_B.weight"
    assert base_weight_name("model.layers.3.mlp.up_proj.base_layer.weight") == (
        "model.layers.3.mlp.up_proj.weight"
    )
    assert base_weight_name("model.norm.weight") == "model.norm.weight"
    assert [vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 300)] == [1, 8, 8, 16, 320]


def test_merging_adds_the_scaled_product_to_each_adapted_weight():
    lora = LoraConfig(rank=2, alpha=3.0, target_modules=("q_proj",))
    g = torch.Generator().manual_seed(0)
    base = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(5, 4, generator=g),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(3, 4, generator=g),
    }
    a, b = torch.randn(2, 4, generator=g), torch.randn(5, 2, generator=g)
    adapter = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a,
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": b,
    }
    merged = merged_weights(base, adapter, lora)
    expected = base["model.layers.0.self_attn.q_proj.weight"].clone()
    for out in range(5):
        for inp in range(4):
            expected[out, inp] += 1.5 * sum(b[out, k] * a[k, inp] for k in range(2))
    torch.testing.assert_close(merged["model.layers.0.self_attn.q_proj.weight"], expected)
    assert torch.equal(
        merged["model.layers.0.self_attn.k_proj.weight"],
        base["model.layers.0.self_attn.k_proj.weight"],
    )
    del adapter["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    with pytest.raises(ValueError, match="does not belong to this base"):
        merged_weights(base, adapter, lora)


def test_an_adapter_directory_loads_in_peft(tmp_path):
    from peft import PeftConfig

    lora = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    folder = adapter_files(tmp_path / "adapter", {name: torch.ones(4, 8)}, lora, "some-base")
    config = PeftConfig.from_pretrained(folder)
    assert (config.r, config.lora_alpha, config.base_model_name_or_path) == (4, 8.0, "some-base")
    assert set(config.target_modules) == {"q_proj", "v_proj"}
    from safetensors.torch import load_file

    assert torch.equal(load_file(folder / "adapter_model.safetensors")[name], torch.ones(4, 8))
