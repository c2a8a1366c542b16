#!/usr/bin/env bash
# Download into .whl/ the wheels a GPU device machine lacks for the learner, the learner
# benchmark and the GPU tests, and print the one command to run there (scripts/gpu_check.sh,
# which installs them).
#
# That machine has Python 3.12 with PyTorch (CUDA), transformers, safetensors, numpy, fsspec,
# pyarrow, pyyaml, xxhash, tqdm, regex, matplotlib, pytest and pytest-timeout, but no network.
# `streamrl.learner`, `storage/` and `benchmarks/learner_bench.py` import nothing else at
# import time beyond the packages below (tests/unit/learner/test_imports.py keeps vLLM, Prefect
# and wandb out of that set). Versions are those this project's virtualenv runs, as py3.12
# manylinux x86-64 wheels. The folder travels with the working tree (64 MiB at most in all),
# so the total is checked against LIMIT_MB.
#
#   scripts/device_wheels.sh            # then carry `.whl` and run scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=.whl
LIMIT_MB=60
PYTHON="${PYTHON:-.venv/bin/python}"

WHEELS=(
    # storage/stream/segments.py: the replay stream is Zarr v3 ...
    "zarr==3.1.6"
    # ... which needs its codecs (Blosc, Zstd), its config and its CRC32C checksum codec
    "numcodecs==0.16.6"
    "donfig==0.8.1.post1"
    "google-crc32c==1.9.0"
    # streamrl/config/run.py: every component's configuration is a pydantic model ...
    "pydantic==2.14.3"
    # ... with its compiled core (pinned exactly by pydantic) and its typing helpers
    "pydantic-core==2.50.4"
    "annotated-types==0.8.0"
    "typing-inspection==0.4.5"
    # pydantic and pydantic-core need typing-extensions >= 4.16; the machine's copy may be
    # older, and a newer one is a drop-in replacement for what else imports it
    "typing-extensions==4.16.0"
)

PLATFORMS=()
for tag in manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 \
    manylinux_2_31 manylinux_2_34 manylinux_2_35; do
    PLATFORMS+=(--platform "${tag}_x86_64")
done

rm -rf "$DEST"
mkdir -p "$DEST"
"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${PLATFORMS[@]}" -d "$DEST" "${WHEELS[@]}"

count=$(find "$DEST" -type f -name '*.whl' | wc -l)
if [[ "$count" -ne "${#WHEELS[@]}" ]]; then
    echo "expected ${#WHEELS[@]} wheels in $DEST, found $count" >&2
    exit 1
fi
bytes=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
echo "$count wheels, $((bytes / 1024)) KiB in $DEST/:"
ls -1 "$DEST"
if ((bytes > LIMIT_MB * 1024 * 1024)); then
    echo "the wheels exceed ${LIMIT_MB} MiB; the working tree that travels holds 64 MiB" >&2
    exit 1
fi

cat <<'CMD'

On the device machine (carry .whl), from the repository root: one call, figures in $OUT

bash scripts/gpu_check.sh
CMD
