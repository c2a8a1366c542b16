"""A LoRA learner over a written stream on the tiny model: versions hold the adapter alone (or
merged weights), checkpoints hold the adapters and their optimiser, and a SIGKILLed learner
resumes to bit-identical adapters; with a real generator, every adapter version is what it
samples with."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM

from storage.checkpoints.dcp import step_dirname
from storage.control.manifest import create_run
from storage.fs import open_location
from storage.stream.reader import StreamReader, StreamTimeoutError
from storage.weights.versions import WeightStore
from streamrl.learner.loop import Learner
from streamrl.learner.topology import Topology
from streamrl.models import resolve_model_path
from streamrl.models.lora import merged_weights
from tests.integration.learner.test_learning import train_with_a_generator
from tests.integration.learner.test_loop import (
    _config,
    _write_stream,
    assert_sigkill_resume_is_exact,
)

LORA = ("model.lora.rank=4", "model.lora.alpha=8", "learner.lr=1e-2")


@pytest.fixture(scope="module")
def topology():
    topo = Topology.from_env("cpu")
    yield topo
    topo.destroy()


def _saved_names(run_dir, step: int) -> list[str]:
    folder = run_dir / "checkpoints" / step_dirname(step)
    return list(FileSystemReader(str(folder)).read_metadata().state_dict_metadata)


def test_a_lora_run_publishes_adapters_and_checkpoints_only_them(tmp_path, topology):
    run_dir = tmp_path / "run"
    _write_stream(run_dir)
    run = open_location(str(run_dir))
    assert Learner(_config(run_dir, 3, *LORA), run, topology).run() == 3

    store = WeightStore(run)
    assert store.versions() == [1, 2, 3]
    first, manifest = store.load(1)
    last, _ = store.load(3)
    assert manifest.model_config["lora_base_model"] == "tiny-qwen2"
    assert all(name.startswith("base_model.model.") and ".lora_" in name for name in first)
    assert any(not torch.equal(first[n], last[n]) for n in first)  # the adapters learn
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-qwen2"))
    assert manifest.stored_bytes < 0.25 * sum(p.numel() * 4 for p in base.parameters())

    names = _saved_names(run_dir, 3)
    model = [n for n in names if n.startswith("policy.model.")]
    assert model
    assert all(".lora_" in n for n in model)  # no frozen base weight in the checkpoint
    assert any(n.startswith("policy.optim.state.") for n in names)


def test_merged_publishing_writes_the_base_with_the_adapter_folded_in(tmp_path, topology):
    run_dir = tmp_path / "run"
    _write_stream(run_dir)
    run = open_location(str(run_dir))
    config = _config(run_dir, 2, *LORA, "weights.lora_publish=merged", "weights.dtype=float32")
    assert Learner(config, run, topology).run() == 2
    merged, manifest = WeightStore(run).load(2)
    assert manifest.model_config == {}
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-qwen2")).state_dict()
    assert merged.keys() == base.keys()
    changed = [n for n in merged if not torch.equal(merged[n], base[n])]
    assert changed
    assert all(n.endswith("_proj.weight") for n in changed)  # only the adapted layers moved


def test_sigkilled_lora_learner_resumes_to_bit_identical_adapters(tmp_path):
    assert_sigkill_resume_is_exact(tmp_path, 6, LORA, groups=60)


def test_merged_export_of_an_adapter_version_is_the_merged_model(tmp_path, topology):
    """Export folds the adapter into the base and can write the PEFT adapter beside it."""
    from peft import PeftModel

    from streamrl.runs.export import export_version

    run_dir = tmp_path / "run"
    _write_stream(run_dir)
    run = open_location(str(run_dir))
    config = _config(run_dir, 2, *LORA)
    create_run(run, config.model_dump(mode="json"))
    Learner(config, run, topology).run()
    out, adapter_dir = tmp_path / "export", tmp_path / "adapter"
    export_version(run, out, adapter_dir=adapter_dir)

    adapter, _ = WeightStore(run).load(2)
    path = resolve_model_path("tiny-qwen2")
    base = AutoModelForCausalLM.from_pretrained(path).state_dict()
    expected = merged_weights(base, adapter, config.model.lora)
    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for name, value in exported.items():
        torch.testing.assert_close(value, expected[name], atol=0, rtol=0)

    ids = torch.tensor([[5, 17, 42, 99, 7, 8, 9]])
    with_adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(path), adapter_dir
    )
    merged_model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        torch.testing.assert_close(
            with_adapter(ids).logits, merged_model(ids).logits, atol=1e-5, rtol=0
        )


def test_a_generator_samples_every_adapter_version_the_learner_publishes(tmp_path):
    """A real generator (vLLM, adapter slot) and a real learner (processes) on one run: each
    published adapter is what the generator samples with — the fresh groups' KL between its
    log-probs and the learner's is ≈ 0 (fp32) at every step that has fresh groups — and the
    stream holds groups of the later versions.

    (The tiny model cannot show learning with LoRA: its tied embeddings are frozen and of norm
    ≈ 0.16, so no hidden state lifts a token's logit by more than ≈ 1.3 nats; the demo model
    shows it, RESULTS.md.)"""
    run_dir = tmp_path / "run"
    records = train_with_a_generator(run_dir, "dapo", 8, 4, "health.mismatch_kl_max=1e-6", *LORA)
    fresh = [record.get("mismatch/kl_k3_fresh") for record in records]
    measured = [kl for kl in fresh if kl is not None]
    assert len(measured) >= 2, fresh
    assert max(measured) < 1e-6, fresh
    versions = set()
    with contextlib.suppress(StreamTimeoutError):  # to the end of the stream
        for group in StreamReader(open_location(str(run_dir))).groups(timeout_s=2):
            versions.add(group.policy_version)
    assert max(versions) >= 2, versions
