"""The tiny model's tokenizer, as the agent tests render with it: its own plain ChatML template
(tools described in the system prompt: the tagged format), and Qwen2.5's tool-aware one
(hermes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from streamrl.models import resolve_model_path

QWEN25_TEMPLATE = (Path(__file__).parents[2] / "qwen25_chat_template.jinja").read_text()


@pytest.fixture(scope="module")
def tagged_tokenizer() -> Any:
    """The tiny model's tokenizer: a plain ChatML template that knows no tools."""
    return AutoTokenizer.from_pretrained(resolve_model_path("tiny-qwen2"))


@pytest.fixture(scope="module")
def hermes_tokenizer() -> Any:
    """The same tokenizer with Qwen2.5's tool-aware (hermes) chat template."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny-qwen2"))
    tokenizer.chat_template = QWEN25_TEMPLATE
    return tokenizer
