#!/usr/bin/env bash
# Fill .whl/ with the cp312 manylinux x86_64 wheels that the GPU machine (Python 3.12, torch 2.11, no network) lacks
# or has at versions our code is not tested with; scripts/gpu_bringup.sh installs them there.
#
#   scripts/gpu_wheels.sh        # run here, from the repo root; then carry `.whl` in the device call
#
# Versions are this project's tested versions (those in .venv); torch, accelerate, tokenizers, huggingface_hub,
# safetensors, numpy, pyarrow, pandas, ... are taken from the GPU machine as they are (checked by check_wheels.py).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DEST=.whl
MAX_MIB=55                                   # the device call carries at most 64 MiB, the repo included
VENV="${VERIFIERS_RL_VENV:-$ROOT/.venv}"     # has torch, needed to build deepspeed's wheel from its sdist

WHEELS=(
    # the project's own dependencies (pyproject.toml)
    transformers==5.23.0    # the GPU machine has 5.17
    trl==1.16.0
    datasets==5.2.0
    peft==0.21.2            # the GPU machine's version is unknown
    math-verify==0.9.0
    gguf==0.19.0
    httpx2==2.16.2
    tenacity==9.2.1
    # what they need that the GPU machine lacks
    latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2     # math-verify
    httpcore2==2.16.2 truststore==0.10.5                              # httpx2
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5   # deepspeed
    einops==0.8.2 hjson==3.1.0                                        # deepspeed
    dill==0.4.1 multiprocess==0.70.19                                 # datasets
    # present there at unknown versions, carried for a recent lower (or upper) bound
    typing-extensions==4.16.0   # pydantic, pydantic-core: >=4.16.0
    fsspec==2026.9.0            # datasets: <=2026.9.0
    tqdm==4.70.1                # datasets: >=4.66.3
    idna==3.20                  # httpx2: >=3.18
    anyio==4.16.0               # httpx2: >=4.10
    pytest-timeout==2.4.0       # pytest.ini's timeout: the dev extra's >=2.4,<2.5
    pytest-xdist==3.8.0 execnet==2.1.2   # pytest.ini's -n: the dev extra's >=3.8,<3.9
)
DEEPSPEED=deepspeed==0.19.8     # sdist only on PyPI: built here into a py3-none-any wheel

rm -rf "$DEST"
mkdir -p "$DEST"

python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST" "${WHEELS[@]}"

# DS_BUILD_OPS=0: no C++/CUDA op is compiled, so the wheel is pure Python (ops JIT-build on the GPU if ever used).
DS_BUILD_OPS=0 "$VENV/bin/python" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "$DEEPSPEED"
ls "$DEST"/deepspeed-*-py3-none-any.whl >/dev/null || { echo "deepspeed wheel is not py3-none-any" >&2; exit 1; }

ls -l "$DEST"
total=$(cat "$DEST"/*.whl | wc -c)
echo "$(ls "$DEST"/*.whl | wc -l) wheels, $total bytes ($((total / 1048576)) MiB; limit $MAX_MIB MiB)"
if (( total > MAX_MIB * 1048576 )); then
    echo "ERROR: .whl is over $MAX_MIB MiB" >&2
    exit 1
fi

# Tags, duplicates and every wheel's requirements against the carried wheels plus the GPU machine's packages.
"$VENV/bin/python" scripts/check_wheels.py "$DEST"
