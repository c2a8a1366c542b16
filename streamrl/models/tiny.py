"""`tiny-qwen2`: a random-init Qwen2 small enough for CPU tests, with a tokenizer built here.

The shape is the smallest vLLM's CPU backend accepts (attention head_dim ≥ 32): hidden 64,
2 heads of 32, 1 KV head, 2 layers, MLP 128. Embeddings are tied to the LM head, as in small
Qwen2 and SmolLM2 models, so the generator's tied-lm_head path is exercised. Everything is
seeded: two builds write identical files.

The tokenizer is a byte-level BPE with Qwen2's pre-tokenizer (digits split one by one),
trained on the bundled datasets' text so the demo's prompts stay short; ChatML special
tokens and chat template as in Qwen2-Instruct (bos/pad `<|endoftext|>`, eos `<|im_end|>`,
no BOS added).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = [
    "CHATML_TEMPLATE",
    "build_qwen2_5_0_5b_shape",
    "build_tiny_qwen2",
    "build_tiny_reward_model",
    "build_tokenizer",
]

VOCAB_SIZE = 1024
# Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer rebuilds exactly this one when it
# loads the directory, so training with it keeps tokenizer.json and AutoTokenizer in agreement).
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_EXTRA_TEXT = (
    "You are a helpful assistant. Let's think step by step.",
    "The answer is 42. So the final answer is \\boxed{42}.",
    "First, we add the numbers. Then we multiply them. Therefore the total is 56.",
    "Answer: 7",
    "Hello! How can I help you today?",
)


def _corpus() -> Iterator[str]:
    # Changing the bundled datasets' text changes this tokenizer: bump the recipe in cache.py.
    from streamrl.data.builtin import arithmetic_pool, math_rows

    for row in [*arithmetic_pool(), *math_rows()]:
        yield row["prompt"][0]["content"]
        yield f"The answer is \\boxed{{{row['reward_model']['ground_truth']}}}."
    yield from _EXTRA_TEXT


def build_tokenizer(vocab_size: int = VOCAB_SIZE):  # -> transformers PreTrainedTokenizerFast
    """The tiny model's tokenizer, trained deterministically on the bundled corpus."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus(), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=2048,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


TINY_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
}


def build_tiny_qwen2(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny model and its tokenizer to `out_dir` (safetensors, float32)."""
    return _build_random_qwen2(out_dir, seed, "float32", **TINY_SHAPE)


def build_tiny_reward_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a tiny sequence classifier (a reward model: one logit) to `out_dir`: the tiny
    model's shape and tokenizer with a seeded random score head (N(0, 1), so scores are O(1)),
    float32. It scores nothing meaningful; it is what tests serve as a reward model."""
    from transformers import Qwen2ForSequenceClassification

    tokenizer = build_tokenizer()
    config = _qwen2_config(tokenizer, "float32", **TINY_SHAPE, num_labels=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForSequenceClassification(config)
        torch.nn.init.normal_(model.score.weight, std=1.0)
    model.config.architectures = ["Qwen2ForSequenceClassification"]
    return save_model_dir(model, tokenizer, Path(out_dir))


def build_qwen2_5_0_5b_shape(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a random-init model of Qwen2.5-0.5B's shape (494M parameters: hidden 896, 24
    layers, 14 heads and 2 KV heads of 64, MLP 4864, vocabulary 151936, tied embeddings) in
    bfloat16, with the tiny model's tokenizer (ids below its 1024 tokens; the rest of the
    vocabulary is never produced by it): the shapes and bytes of a real model for weight-path
    and GPU benchmarks, without a model hub."""
    return _build_random_qwen2(
        out_dir,
        seed,
        "bfloat16",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    )


def _build_random_qwen2(out_dir: str | Path, seed: int, dtype: str, **shape: object) -> Path:
    """A seeded random-init Qwen2 of `shape` (vocabulary: the tokenizer's unless given), tied
    embeddings and ChatML ids, saved in `dtype` with the tiny tokenizer."""
    from transformers import Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    config = _qwen2_config(tokenizer, dtype, tie_word_embeddings=True, **shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    return save_model_dir(model, tokenizer, Path(out_dir))


def _qwen2_config(tokenizer, dtype: str, **fields: object):  # -> transformers Qwen2Config
    """A Qwen2 config over `tokenizer` (its vocabulary unless `fields` gives one; ChatML ids)."""
    from transformers import Qwen2Config

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return Qwen2Config(
        **{"vocab_size": len(tokenizer), **fields},
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        dtype=dtype,
    )


def save_model_dir(model, tokenizer, out_dir: str | Path) -> Path:  # transformers objects
    """Save a model and its tokenizer as a Hugging Face directory, with a generation config
    that carries the model's own bos/eos/pad ids (not transformers' defaults)."""
    from transformers import GenerationConfig

    config = model.config
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return Path(out_dir)
