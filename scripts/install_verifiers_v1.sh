#!/usr/bin/env bash
# Install verifiers 0.4 (the `verifiers.v1` API) into its OWN virtual environment: it cannot share the trainer's
# (0.4 pins mcp==2.0.0, the [verifiers] extra's 0.3.1 mcp<2). The trainer runs v1 environments through a worker
# in this venv (verifiers_rl/v1_worker/episode_worker.py) and talks to it over stdin/stdout, its model calls over
# the loopback generate endpoint.
#
#   scripts/install_verifiers_v1.sh [VENV_DIR]   # default: $VERIFIERS_RL_V1_VENV or <repo>/.venv-verifiers-v1
#
# Idempotent: a venv where verifiers 0.4.0 and uv already import/run is left alone (FORCE=1 reinstalls).
# ~1 min and ~0.6 GB (no torch: the train client only tokenizes). uv is installed too: v1's `null` chat harness
# runs its program with `uv sync --script`, and would otherwise try to download uv at rollout time.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${VERIFIERS_RL_V1_VENV:-$ROOT/.venv-verifiers-v1}}"
PYTHON="${PYTHON:-python3}"
VERIFIERS_VERSION="0.4.0"

check() {
    "$VENV/bin/python" - <<PY
import importlib.metadata
version = importlib.metadata.version("verifiers")
assert version == "$VERIFIERS_VERSION", f"verifiers {version}, expected $VERIFIERS_VERSION"
import verifiers.v1 as vf
assert vf.TrainClientConfig and vf.load_environment and vf.resolve_env_config
print(f"verifiers {version} (verifiers.v1), renderers {importlib.metadata.version('renderers')}")
PY
    "$VENV/bin/uv" --version
}

if [[ -x "$VENV/bin/python" && -z "${FORCE:-}" ]] && check >/dev/null 2>&1; then
    echo "[install_verifiers_v1] $VENV already has verifiers $VERIFIERS_VERSION; nothing to do (FORCE=1 reinstalls)."
    exit 0
fi

echo "[install_verifiers_v1] creating $VENV"
"$PYTHON" -m venv "$VENV"
echo "[install_verifiers_v1] pip install verifiers==$VERIFIERS_VERSION uv"
"$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off -q "verifiers==$VERIFIERS_VERSION" uv
echo "[install_verifiers_v1] checking"
check
echo "[install_verifiers_v1] done: $VENV"
