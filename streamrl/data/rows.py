"""Raw dataset rows: bundled sets, or JSONL / Parquet files on any fsspec URL.

A row is a dict as the file holds it; `field_value` reaches into it with the dotted paths of
`DataConfig.prompt_field` / `answer_field`. Every user mistake raises `DatasetError` naming
the file, the row and the setting to change.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping
from typing import Any

import fsspec

from streamrl.config.base import ConfigError
from streamrl.data.builtin import BUILTIN_DATASETS, builtin_rows

__all__ = [
    "BUILTIN_PREFIX",
    "DatasetError",
    "MissingFieldError",
    "dataset_name",
    "field_value",
    "load_rows",
]

BUILTIN_PREFIX = "builtin:"
_EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
_COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")


class DatasetError(ConfigError):
    """A dataset the user must fix (missing file, unknown format, row without a field)."""

    def __init__(self, problem: str) -> None:
        super().__init__([problem], source="dataset")


class MissingFieldError(KeyError):
    """`field_value` found nothing at `path`; `keys` are those where the walk stopped."""

    def __init__(self, path: str, where: str, keys: list[str]) -> None:
        super().__init__(path)
        self.path, self.where, self.keys = path, where, keys


def field_value(row: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted path ("reward_model.ground_truth", "prompt.0.content"); a key that
    itself contains dots is matched whole first. Raises `MissingFieldError` when absent or null."""
    if row.get(path) is not None:
        return row[path]
    value: Any = row
    walked: list[str] = []
    for part in path.split("."):
        if isinstance(value, Mapping) and value.get(part) is not None:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            keys = [str(k) for k in value] if isinstance(value, Mapping) else []
            raise MissingFieldError(path, ".".join(walked), keys)
        walked.append(part)
    return value


def _infer_format(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    name = posixpath.basename(path).lower()
    for suffix in _COMPRESSIONS:
        name = name.removesuffix(suffix)
    extension = posixpath.splitext(name)[1]
    if extension not in _EXTENSIONS:
        raise DatasetError(
            f"cannot tell the format of dataset '{path}' from its extension "
            f"('{extension or 'none'}'; known: {', '.join(_EXTENSIONS)}); set data.format=jsonl "
            "or data.format=parquet"
        )
    return _EXTENSIONS[extension]


def _read_jsonl(fs: fsspec.AbstractFileSystem, path: str) -> list[dict[str, Any]]:
    rows = []
    with fs.open(path, "rt", compression="infer", encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path} line {number} is not valid JSON: {exc}") from None
            except RecursionError:  # the decoder recurses once per level: thousands deep
                raise DatasetError(
                    f"{path} line {number} nests lists or objects thousands of levels deep, "
                    "more than can be read; write the row flatter"
                ) from None
            if not isinstance(row, dict):
                raise DatasetError(
                    f"{path} line {number} must be a JSON object, got {type(row).__name__}"
                )
            rows.append(row)
    return rows


def _read_parquet(
    fs: fsspec.AbstractFileSystem, path: str, fields: tuple[str, ...], optional: tuple[str, ...]
) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(
            f"reading the Parquet dataset '{path}' needs pyarrow, which is not installed; "
            "`pip install pyarrow`, or convert the file to JSONL"
        ) from None
    with fs.open(path, "rb") as file:
        parquet = pq.ParquetFile(file)
        names = parquet.schema_arrow.names
        columns = {f if f in names else f.split(".", 1)[0] for f in fields}
        missing = sorted(c for c in columns if c not in names)
        if missing:
            raise DatasetError(
                f"{path} has no column '{missing[0]}' (columns: {', '.join(names)}); set "
                "data.prompt_field=... / data.answer_field=... to the right column"
            )
        columns |= {c for f in optional if (c := f.split(".", 1)[0]) in names}
        return parquet.read(columns=sorted(columns)).to_pylist()


def load_rows(
    path: str,
    fmt: str = "auto",
    *,
    fields: tuple[str, ...] = (),
    optional: tuple[str, ...] = (),
    storage_options: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """All rows of a dataset: `builtin:NAME`, or a JSONL / Parquet file at a path or fsspec URL.

    `fields` (dotted paths) limits the Parquet columns read to those the caller needs, and
    `optional` adds those it reads where the file has them.
    """
    if path.startswith(BUILTIN_PREFIX):
        name = path.removeprefix(BUILTIN_PREFIX)
        if name not in BUILTIN_DATASETS:
            known = ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_DATASETS)
            raise DatasetError(f"unknown bundled dataset '{path}'; choose one of: {known}")
        return builtin_rows(name)
    fmt = _infer_format(path, fmt)
    fs, fs_path = fsspec.core.url_to_fs(path, **dict(storage_options or {}))
    if not fs.isfile(fs_path):
        raise DatasetError(
            f"dataset file '{path}' does not exist; set data.path to a JSONL or Parquet file "
            f"(local path or URL such as s3://...) or a bundled dataset: "
            f"{', '.join(BUILTIN_PREFIX + n for n in BUILTIN_DATASETS)}"
        )
    return (
        _read_parquet(fs, fs_path, fields, optional)
        if fmt == "parquet"
        else _read_jsonl(fs, fs_path)
    )


def dataset_name(path: str) -> str:
    """A short name for prompt ids: the bundled name, or the file name without extensions."""
    if path.startswith(BUILTIN_PREFIX):
        return path.removeprefix(BUILTIN_PREFIX)
    name = posixpath.basename(path.rstrip("/"))
    for suffix in _COMPRESSIONS:
        name = name.removesuffix(suffix)
    return posixpath.splitext(name)[0]
