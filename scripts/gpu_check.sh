#!/usr/bin/env bash
# The GPU machine's whole run in one command (`benchmarks/gpu_check.py`): install the wheels it
# lacks, then the environment, the `gpu` tests, the learner benchmark on the 0.5B shape,
# SDPA against FlexAttention, a publish from GPU memory, and the learner beside a generator's
# stand-in on one GPU (the weight hand-off), each under its own time budget,
# the whole within 8 minutes. Figures go to $OUT/gpu_check.json and $OUT/gpu_check.log as
# each part ends.
#
#   scripts/device_wheels.sh                      # here, once: the wheels into .whl/
#   scripts/gpu_check.sh                          # there (carry .whl), from the repo root
#   scripts/gpu_check.sh --device cpu --dry-run   # here: every part on tiny shapes
#
# Options after the script's name go to `python -m benchmarks.gpu_check` (--parts, --out).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -x .venv/bin/python ]]; then
    PYTHON="${PYTHON:-.venv/bin/python}"
else
    PYTHON="${PYTHON:-python3}"  # the GPU machine: its own Python holds PyTorch
fi
export PYTHONUNBUFFERED=1 STREAMRL_CACHE="${STREAMRL_CACHE:-/tmp/streamrl-cache}"
export HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error

# The carried wheels (scripts/device_wheels.sh), where this Python lacks what they hold.
shopt -s nullglob
wheels=(.whl/*.whl)
if ((${#wheels[@]})) && ! "$PYTHON" -c "import pydantic, zarr, numcodecs" 2>/dev/null; then
    started=$EPOCHREALTIME
    "$PYTHON" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target /tmp/streamrl-site "${wheels[@]}"
    export PYTHONPATH="/tmp/streamrl-site${PYTHONPATH:+:$PYTHONPATH}"
    GPU_CHECK_WHEELS_S=$(awk "BEGIN { printf \"%.1f\", $EPOCHREALTIME - $started }")
    export GPU_CHECK_WHEELS_S
    echo "installed ${#wheels[@]} carried wheels in ${GPU_CHECK_WHEELS_S} s"
fi

exec "$PYTHON" -m benchmarks.gpu_check "$@"
