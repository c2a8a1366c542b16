"""The `model` section: the policy model generators and the learner share, and the value model
(`model.critic`, VAPO).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from streamrl.config.base import MAX_SEQUENCE_TOKENS, Section
from streamrl.models.lora import LoraConfig

__all__ = [
    "CriticConfig",
    "ModelConfig",
]


class CriticConfig(Section):
    """The value model (VAPO): the policy's backbone with a scalar head."""

    init_from: str = Field(
        "policy",
        min_length=1,
        description="'policy' to start from the policy's weights, or a path to a reward model.",
    )


class ModelConfig(Section):
    """The policy model, shared by generators and the learner."""

    path: str = Field(
        "smollm2-135m-instruct",
        min_length=1,
        description="Hugging Face model directory (local or fsspec URL), or a bundled model "
        "prepared by `streamrl models prepare`: tiny-qwen2, smollm2-135m-instruct.",
    )
    tokenizer: str | None = Field(
        None, description="Tokenizer directory when it differs from `path`."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16",
        description="Parameter dtype for generation and the learner's compute. float32 makes "
        "generator and learner log-probs agree exactly on CPU.",
    )
    max_model_len: int = Field(
        2048,
        gt=0,
        le=MAX_SEQUENCE_TOKENS,
        description="Longest prompt + response in tokens (vLLM max_model_len).",
    )
    trust_remote_code: bool = Field(
        False, description="Allow model code from the model directory (transformers/vLLM)."
    )
    critic: CriticConfig | None = Field(
        None, description="Value model; required by vapo, unused (and rejected) otherwise."
    )
    lora: LoraConfig | None = Field(
        None,
        description="Train LoRA adapters on the frozen base instead of every weight (off when "
        "unset). A critic stays a full model.",
    )
