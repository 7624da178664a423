#!/usr/bin/env bash
# Install verifiers 0.4 (the `verifiers.v1` API) into its OWN virtual environment: it cannot share the trainer's
# (0.4 pins mcp==2.0.0, the [verifiers] extra's 0.3.1 mcp<2). The trainer runs v1 environments through a worker
# in this venv (verifiers_rl/v1_worker/episode_worker.py) and talks to it over stdin/stdout, its model calls over
# the loopback generate endpoint.
#
#   scripts/install_verifiers_v1.sh [VENV_DIR]   # default: $VERIFIERS_RL_V1_VENV or <repo>/.venv-verifiers-v1
#
# Idempotent: a venv where verifiers 0.4.0 and uv already import/run, and whose null-harness script syncs offline,
# is left alone (FORCE=1 reinstalls). ~1 min and ~0.6 GB (no torch: the train client only tokenizes). uv is
# installed too: v1's `null` chat harness runs its program with `uv sync --script`, and would otherwise try to
# download uv at rollout time. That program's own dependencies (openai, mcp, httpx, ...) are synced here, into uv's
# cache (~60 MB): rollouts run uv with UV_OFFLINE=1 and download nothing.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${VERIFIERS_RL_V1_VENV:-$ROOT/.venv-verifiers-v1}}"
PYTHON="${PYTHON:-python3}"
VERIFIERS_VERSION="0.4.0"

# Checks the venv (exit status: all of it, `&&`: a function run as a condition ignores `set -e`) and writes the
# null harness's PEP 723 script, imported from v1, where v1's subprocess runtime writes it (uv keys the script's
# environment by its path: a rollout then finds that environment built). One python, as verifiers.v1 takes seconds
# to import.
check() {
    "$VENV/bin/python" - <<PY && "$VENV/bin/uv" --version
import hashlib
import importlib.metadata
import os
from pathlib import Path

version = importlib.metadata.version("verifiers")
assert version == "$VERIFIERS_VERSION", f"verifiers {version}, expected $VERIFIERS_VERSION"
import verifiers.v1 as vf
from verifiers.v1.harnesses.null.harness import CHAT_PROGRAM_SOURCE
from verifiers.v1.runtimes.subprocess import SubprocessRuntime

assert vf.TrainClientConfig and vf.load_environment and vf.resolve_env_config
print(f"verifiers {version} (verifiers.v1), renderers {importlib.metadata.version('renderers')}")
data = CHAT_PROGRAM_SOURCE.encode()
path = Path(SubprocessRuntime.scripts_dir) / f"{hashlib.sha256(data).hexdigest()}.py"  # as prepare_uv_script names it
if not path.is_file() or path.read_bytes() != data:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # atomic, as v1's own \`mv -f\`: a running rollout never reads half a script
print(f"null harness script: {path}")
PY
}

# v1's preparation of the script (Runtime.prepare_uv_script's `uv sync --script` and `uv python find --script`), run
# with the venv's uv, from the scripts' folder, with the PATH a rollout has (v1's $HOME/.local/bin, then the venv's
# bin as EpisodeWorker.start puts it) and UV_OFFLINE=$1; prints the interpreter uv picks.
sync_harness_script() {
    local script="$2"
    (cd "$(dirname "$script")" && export PATH="$HOME/.local/bin:$VENV/bin:$PATH" UV_OFFLINE="$1" &&
        "$VENV/bin/uv" sync --script "$script" -q --no-config &&
        "$VENV/bin/uv" python find --script "$script" --no-config)
}

CHECKED=""
if [[ -x "$VENV/bin/python" && -z "${FORCE:-}" ]]; then
    CHECKED="$(check 2>/dev/null)" || CHECKED=""
fi
if [[ -n "$CHECKED" ]]; then
    SCRIPT="$(sed -n 's/^null harness script: //p' <<<"$CHECKED")"
    if sync_harness_script 1 "$SCRIPT" >/dev/null 2>&1; then
        echo "[install_verifiers_v1] $VENV already has verifiers $VERIFIERS_VERSION and the null harness's script" \
            "synced; nothing to do (FORCE=1 reinstalls)."
        exit 0
    fi
    echo "[install_verifiers_v1] $VENV already has verifiers $VERIFIERS_VERSION"
else
    echo "[install_verifiers_v1] creating $VENV"
    "$PYTHON" -m venv "$VENV"
    echo "[install_verifiers_v1] pip install verifiers==$VERIFIERS_VERSION uv"
    "$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off -q \
        "verifiers==$VERIFIERS_VERSION" uv
    echo "[install_verifiers_v1] checking"
    CHECKED="$(check)"
    echo "$CHECKED"
    SCRIPT="$(sed -n 's/^null harness script: //p' <<<"$CHECKED")"
fi
echo "[install_verifiers_v1] uv sync --script $SCRIPT (the null harness's program: its dependencies into uv's cache)"
sync_harness_script false "$SCRIPT" >/dev/null
echo "[install_verifiers_v1] checking it syncs offline, as rollouts run it (UV_OFFLINE=1)"
INTERPRETER="$(sync_harness_script 1 "$SCRIPT")"
echo "[install_verifiers_v1] the null harness's program runs with $INTERPRETER"
echo "[install_verifiers_v1] done: $VENV"
