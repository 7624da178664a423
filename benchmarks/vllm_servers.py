"""Training over one and over two vLLM servers on this machine: requests and tokens per server, and the step time.

Each configuration is one ``python -m verifiers_rl.inference.vllm.server --num-servers N --then`` launch (the
launcher starts the N servers on consecutive ports and hands the training run their comma-joined URLs) of the tiny
test Llama (hidden 64) on reverse_text: 8 steps of 4 prompts x 4 samples, k = 1, ``files`` weight syncs probed every
step. The table gives, per configuration, each server's requests and completion tokens and the median step and
generation seconds (steps 2..N: step 1 includes the warm-up).

A report, not a promise: here every server and the trainer share the same cores, so a second server competes with
the first instead of adding compute (docs/scaling.md says what to expect with servers on separate machines).

Run (about 4 minutes on 2 cores; servers start for each configuration):

    PYTHONPATH=. .venv/bin/python benchmarks/vllm_servers.py
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from anywhere without PYTHONPATH
    sys.path.insert(0, str(ROOT))

from timing import at_least  # noqa: E402  (benchmarks/timing.py)

RUNNER = ROOT / "tests" / "vllm_backend" / "train_run.py"  # the training command, plus its ENGINE_STATE line


def run(model_dir: Path, servers: int, steps: int, out: Path) -> dict:
    from verifiers_rl.core.engine import free_port
    from verifiers_rl.core.rollout import read_rollouts

    port = free_port()  # the launcher takes port, port + 1, ...
    command = [
        sys.executable, "-m", "verifiers_rl.inference.vllm.server", "--model", str(model_dir), "--port", str(port),
        "--num-servers", str(servers), "--max-model-len", "512", "--log", str(out / "server.log"), "--then",
        sys.executable, str(RUNNER), "--model", str(model_dir), "--env", "reverse_text",
        "--env_args", '{"num_examples": 64}', "--max_steps", str(steps), "--rollouts_per_step", "16",
        "--num_generations", "4", "--max_seq_len", "128", "--max_off_policy_steps", "1", "--learning_rate", "0.01",
        "--logging_steps", "1", "--print_samples_every", "0", "--weight_sync_probe_every", "1",
        "--save_rollouts_path", str(out / "rollouts.jsonl"), "--report_to", "none", "--save_strategy", "no",
        "--output_dir", str(out / "model"),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "VLLM_API_KEY": os.environ.get("VLLM_API_KEY") or secrets.token_hex(8)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{servers} server(s): exit {done.returncode}\n{(done.stdout + done.stderr)[-4000:]}")
    lines = done.stdout.splitlines()
    fields = [dict(part.split(" ", 1) for part in line.split(" | ")[1:] if " " in part)
              for line in lines if line.startswith("step ")]
    state = json.loads(next(line for line in lines if line.startswith("ENGINE_STATE ")).split(" ", 1)[1])
    per_server = state["health"].get("servers") or [{
        "requests": state["requests_served"],
        "tokens": sum(len(r.completion_ids) for r in read_rollouts(out / "rollouts.jsonl")),
    }]
    return {
        "servers": servers,
        "requests": [s["requests"] for s in per_server],
        "tokens": [s["tokens"] for s in per_server],
        "step_s": statistics.median(float(f["step"].rstrip("s")) for f in fields[1:]),
        "gen_s": statistics.median(float(f["gen"].rstrip("s")) for f in fields[1:]),
    }


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per configuration (at least 2: the "
                        "medians leave step 1 out)")
    args = parser.parse_args(argv)
    # Checked before any server starts: the medians are over steps 2..N.
    at_least(parser, args, 2, "steps", why="step 1 includes the warm-up and is left out")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    from verifiers_rl.core.models import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny", hidden_size=64, seed=0)
        rows = []
        for servers in (1, 2):
            out = Path(tmp) / f"run{servers}"
            out.mkdir()
            rows.append(run(model_dir, servers, args.steps, out))
    print("| servers | requests per server | completion tokens per server | median step s | median gen s |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['servers']} | {' / '.join(map(str, row['requests']))} | "
              f"{' / '.join(map(str, row['tokens']))} | {row['step_s']:.2f} | {row['gen_s']:.2f} |")


if __name__ == "__main__":
    main()
