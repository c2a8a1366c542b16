"""Export a published weight version as a Hugging Face model directory.

`export_version(run, out_dir, version)` writes what `AutoModelForCausalLM.from_pretrained` and
vLLM load directly:

    config.json                        the run's model config (model.path), updated with the
                                       manifest's model_config when the publisher recorded one,
                                       its dtype set to the exported weights' dtype
    generation_config.json             copied, when the source model has one
    tokenizer files, chat template     saved from model.tokenizer (else model.path)
    model.safetensors                  or model-0000i-of-0000N.safetensors + the index
    *.py                               the source model's own code, if any (trust_remote_code)

Weights come from the run's weight store, every shard verified against its manifest. A LoRA
run's adapter version (`weights.lora_publish=adapter`) is folded into the base model of
model.path (W + (α/r)·B·A); `adapter_dir` also writes the adapter itself as a PEFT directory. A tied
lm_head (`tie_word_embeddings`) is published under both names; the export keeps only the
embedding, as Hugging Face checkpoints do, after checking the two are equal. Before anything is
written the tensors are checked against the model the config describes (names and shapes), so
an export that loads is an export of the right model.

The directory appears complete or not at all: everything is written into a temporary folder
next to `out_dir` and renamed into place at the end.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

import torch

from storage.fs import Location
from storage.weights.versions import WeightManifest, WeightStore, WeightVersionNotFoundError
from streamrl.config.run import RunConfig
from streamrl.models.lora import adapter_files, merged_weights

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "OutputExistsError", "export_version"]

log = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # Hugging Face's default shard size
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TIED = ("lm_head.weight", "model.embed_tokens.weight")


class OutputExistsError(FileExistsError):
    """The output directory holds files and `overwrite` was not given."""


def export_version(
    run: Location,
    out_dir: str | Path,
    version: int | None = None,
    *,
    overwrite: bool = False,
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    adapter_dir: str | Path | None = None,
) -> Path:
    """Write weight `version` of `run` (default: the latest) as a Hugging Face model directory.

    Args:
        out_dir: a local directory; it must not exist or be empty unless `overwrite`.
        dtype: float32 / bfloat16 / float16 to cast the weights to; default as published.
        max_shard_bytes: the largest safetensors file; more weights are sharded with an index.
        adapter_dir: for a LoRA run's adapter version, also write the adapter itself there as a
            PEFT adapter directory (`peft.PeftModel.from_pretrained(base, adapter_dir)`).

    Returns the directory written. Raises `OutputExistsError` for a non-empty `out_dir`,
    `WeightVersionNotFoundError` (a `StorageError`) for a run without weights or an unknown
    version (the message lists the available ones), `StorageError` when `run` holds no run.
    """
    from streamrl.config.stored import load_run_config
    from streamrl.models import resolve_model_path

    out = Path(out_dir).expanduser().absolute()
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)} or None, got {dtype!r}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise OutputExistsError(
            f"{out} exists and is not an empty directory; choose another output directory or "
            "pass overwrite=True (--overwrite)"
        )
    config = load_run_config(run)  # StorageError when `run` holds no run
    store = WeightStore(run)
    if version is None and store.latest_version() is None:
        raise WeightVersionNotFoundError(
            f"run {run.uri} has no published weights yet (nothing under {store.root.uri}); "
            "export after the learner has published a version"
        )
    state, manifest = store.load(version)
    model_path = Path(resolve_model_path(config.model.path))
    adapter = None
    if "lora_adapter" in manifest.model_config:  # an adapter version: fold it into the base
        adapter, state = state, _merged_into_base(state, model_path, config)
    elif adapter_dir is not None:
        raise ValueError(
            f"weights v{manifest.version} of {run.uri} are whole models, not a LoRA adapter: "
            "export them without an adapter directory (--adapter-out)"
        )
    model_config = _model_config(model_path, manifest, state, dtype)
    state = _exported_tensors(state, model_config, dtype)
    _check_against_model(state, model_config, config.model.trust_remote_code, model_path)

    out.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write(building, state, model_config, model_path, config, max_shard_bytes)
        _move_into_place(building, out)
    finally:
        if building.exists():
            shutil.rmtree(building)
    if adapter is not None and adapter_dir is not None:
        adapter_files(adapter_dir, adapter, config.model.lora, config.model.path)
        log.info("wrote the adapter of weights v%d to %s", manifest.version, adapter_dir)
    log.info("exported weights v%d of %s to %s", manifest.version, run.uri, out)
    return out


def _merged_into_base(
    adapter: dict[str, torch.Tensor], model_path: Path, config: RunConfig
) -> dict[str, torch.Tensor]:
    """The base model's weights (model.path) with the published adapter folded in, in the
    base's dtype; a tied LM head under both names, as published full versions carry it."""
    from safetensors.torch import load_file

    if config.model.lora is None:
        raise ValueError("the version is a LoRA adapter but the run's config has no model.lora")
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model.path {model_path} has no safetensors weights to merge into")
    base: dict[str, torch.Tensor] = {}
    for file in files:
        base.update(load_file(file))
    return merged_weights(base, adapter, config.model.lora)


def _model_config(
    model_path: Path, manifest: WeightManifest, state: dict[str, torch.Tensor], dtype: str | None
) -> dict:
    """config.json of the source model, updated with what the publisher recorded, with the
    dtype of the exported weights (what "auto" dtype loading then picks)."""
    source = model_path / "config.json"
    if not source.is_file():
        raise FileNotFoundError(f"model.path {model_path} has no config.json to export with")
    recorded = {k: v for k, v in manifest.model_config.items() if not k.startswith("lora_")}
    config = {**json.loads(source.read_text()), **recorded}
    floats = {t.dtype for t in state.values() if t.is_floating_point()}
    exported = dtype or (str(floats.pop()).removeprefix("torch.") if len(floats) == 1 else None)
    if exported is not None:
        # transformers ≥ 5 writes "dtype"; older checkpoints say "torch_dtype".
        key = "torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"
        config[key] = exported
    return config


def _exported_tensors(
    state: dict[str, torch.Tensor], model_config: dict, dtype: str | None
) -> dict[str, torch.Tensor]:
    """The tensors to save: cast when asked, a tied lm_head left to the embedding."""
    head, embedding = _TIED
    if model_config.get("tie_word_embeddings") and head in state and embedding in state:
        if not torch.equal(state[head], state[embedding]):
            raise ValueError(
                f"the model config ties word embeddings but the published {head} differs from "
                f"{embedding}; the weights do not belong to this model config"
            )
        state = {name: t for name, t in state.items() if name != head}
    if dtype is not None:
        target = _DTYPES[dtype]
        state = {n: t.to(target) if t.is_floating_point() else t for n, t in state.items()}
    return state


def _check_against_model(
    state: dict[str, torch.Tensor], model_config: dict, trust_remote_code: bool, model_path: Path
) -> None:
    """Build the model on the meta device and compare tensor names and shapes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as folder:  # AutoConfig reads a directory
        (Path(folder) / "config.json").write_text(json.dumps(model_config))
        for code in model_path.glob("*.py"):
            shutil.copy2(code, folder)
        hf_config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if model_config.get("tie_word_embeddings"):
        expected.pop(_TIED[0], None)
    got = {name: tuple(t.shape) for name, t in state.items()}
    problems = [f"missing {n}" for n in sorted(expected.keys() - got.keys())]
    problems += [f"unexpected {n}" for n in sorted(got.keys() - expected.keys())]
    problems += [
        f"{n}: shape {got[n]}, the model has {expected[n]}"
        for n in sorted(expected.keys() & got.keys())
        if got[n] != expected[n]
    ]
    if problems:
        shown = "; ".join(problems[:5]) + (
            f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
        )
        raise ValueError(
            f"the published weights do not fit the model of model.path {model_path}: {shown}"
        )


def _write(
    folder: Path,
    state: dict[str, torch.Tensor],
    model_config: dict,
    model_path: Path,
    config: RunConfig,
    max_shard_bytes: int,
) -> None:
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoTokenizer

    from streamrl.models import resolve_model_path

    (folder / "config.json").write_text(json.dumps(model_config, indent=2, sort_keys=True) + "\n")
    if (model_path / "generation_config.json").is_file():
        shutil.copy2(model_path / "generation_config.json", folder)
    for code in model_path.glob("*.py"):
        shutil.copy2(code, folder)
    tokenizer_path = resolve_model_path(config.model.tokenizer or config.model.path)
    tokenizer = AutoTokenizer.from_pretrained(
        tokenizer_path, trust_remote_code=config.model.trust_remote_code
    )
    tokenizer.save_pretrained(folder)
    save_torch_state_dict(state, folder, max_shard_size=max_shard_bytes, metadata={"format": "pt"})


def _move_into_place(building: Path, out: Path) -> None:
    """Rename the finished folder to `out`; an existing `out` (empty, or being overwritten) is
    moved aside first and deleted only once the new one is in place."""
    building.chmod(0o755)  # mkdtemp's owner-only mode is no mode for a model directory
    if not out.exists():
        building.rename(out)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    aside.rmdir()
    out.rename(aside)
    try:
        building.rename(out)
    except OSError:
        aside.rename(out)  # put the old one back
        raise
    if aside.is_dir():
        shutil.rmtree(aside)
    else:
        aside.unlink()
