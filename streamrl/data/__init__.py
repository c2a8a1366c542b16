"""Prompt datasets for generators: JSONL / Parquet on fsspec or bundled sets, sharded and resumable.

`PromptSource(config.data, tokenizer_path)` loads, renders and tokenises a dataset;
`source.iterate(shard, num_shards, start)` walks one generator's share of it forever
(see `streamrl.data.datasets` for the order and resume semantics).

Imports: `streamrl.config.base`, `streamrl.models` (tokenizers).
"""

from streamrl.data.builtin import BUILTIN_DATASETS, builtin_rows
from streamrl.data.datasets import Prompt, PromptIterator, PromptPosition, PromptSource
from streamrl.data.rows import DatasetError, MissingFieldError, field_value, load_rows

__all__ = [
    "BUILTIN_DATASETS",
    "DatasetError",
    "MissingFieldError",
    "Prompt",
    "PromptIterator",
    "PromptPosition",
    "PromptSource",
    "builtin_rows",
    "field_value",
    "load_rows",
]
