#!/usr/bin/env bash
# Bring up the lent GPU machine (Python 3.12 at /opt/torch/.venv, torch 2.11 CUDA, no network) for this project:
# install the wheels of .whl/ into /tmp/site, put /tmp/site and the repo on PYTHONPATH, go offline, and check that
# the GPU and every package the trainer needs import. Fails (non-zero) if any of that does not work.
#
#   source scripts/gpu_bringup.sh && python3 -m pytest ...    # sourced: the exports stay in this shell
#   scripts/gpu_bringup.sh                                     # or executed: install and check only
#
# Run scripts/gpu_wheels.sh HERE (the development machine) first, and name `.whl` in the device call's carry
# (it is git-ignored, so it does not travel otherwise). Run from the repo root.

_verifiers_rl_gpu_bringup() {
    local root
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    (
        set -euo pipefail
        cd "$root"
        compgen -G ".whl/*.whl" >/dev/null || { echo "gpu_bringup: no .whl/*.whl: run scripts/gpu_wheels.sh and carry .whl" >&2; exit 1; }
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    ) || return 1
    export PYTHONPATH="/tmp/site:$root"
    export HF_HUB_OFFLINE=1
    export TOKENIZERS_PARALLELISM=false
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || return 1
    # RLTrainer (not only the lazy package) so that trl, datasets, peft and deepspeed load as training loads them.
    python3 -c "import torch, transformers, trl, accelerate, deepspeed, datasets, peft, verifiers_rl; from verifiers_rl import RLTrainer; print('torch', torch.__version__, '| transformers', transformers.__version__, '| trl', trl.__version__, '| accelerate', accelerate.__version__, '| deepspeed', deepspeed.__version__, '| datasets', datasets.__version__, '| peft', peft.__version__, '| verifiers_rl', verifiers_rl.__file__, '|', torch.cuda.get_device_name(0))" || return 1
}

if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then
    _verifiers_rl_gpu_bringup || { echo "gpu_bringup: FAILED" >&2; unset -f _verifiers_rl_gpu_bringup; return 1; }
    unset -f _verifiers_rl_gpu_bringup
else
    set -euo pipefail
    _verifiers_rl_gpu_bringup || { echo "gpu_bringup: FAILED" >&2; exit 1; }
fi
