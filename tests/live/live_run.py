"""Live training from an environment through the embedded engine, in one or more processes.

Writes ``<out>/<name>.json`` (main process) with the per-step reward, IS ratio and staleness, so the test can check
that the reward rises, that sampler and trainer log-probs agree right after every weight load (k = 0), and that
staleness never exceeds k.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from accelerate import PartialState
from transformers import AutoTokenizer

from verifiers_rl.config import RLConfig
from verifiers_rl.envs import load_environment
from verifiers_rl.inference import EmbeddedEngine, SamplingConfig
from verifiers_rl.trainer import RLTrainer

TOY_ENV = str(Path(__file__).with_name("toy_env.py"))


def run(model: str, k: int, steps: int, out: Path, env: str, env_args: dict, timeout_s: float) -> None:
    args = RLConfig(
        output_dir=str(out / f"trainer_k{k}"), use_cpu=True, report_to="none", save_strategy="no", logging_steps=1,
        max_steps=steps, learning_rate=3e-3, lr_scheduler_type="constant", rollouts_per_step=32, num_generations=8,
        max_seq_len=64, max_off_policy_steps=k, loss_type="token_mean", gradient_checkpointing=False,
        disable_tqdm=True, seed=0, generation_timeout_s=timeout_s,
    )
    tokenizer = AutoTokenizer.from_pretrained(model)
    environment = load_environment(env, tokenizer=tokenizer, **env_args)
    # The engine lives on the main process only, with its own copy of the weights.
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8)
    engine = EmbeddedEngine(model, tokenizer, sampling, generate_in_loop_thread=k == 0) if PartialState().is_main_process else None
    trainer = RLTrainer(model, args, processing_class=tokenizer, environment=environment, engine=engine)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "reward" in entry]
    if trainer.accelerator.is_main_process:
        record = {key: [entry.get(key) for entry in logged] for key in ("reward", "is_ratio", "staleness_max", "reward_errors")}
        record["num_processes"] = trainer.accelerator.num_processes
        (out / f"k{k}.json").write_text(json.dumps(record))
    trainer.accelerator.wait_for_everyone()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--k", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--env", default=TOY_ENV)
    parser.add_argument("--env_args", default="{}")
    parser.add_argument("--timeout_s", type=float, default=120.0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for k in args.k:
        run(args.model, k, args.steps, out, args.env, json.loads(args.env_args), args.timeout_s)


if __name__ == "__main__":
    main()
