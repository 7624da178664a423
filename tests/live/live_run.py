"""Live training from an environment through the embedded engine, in one or more processes.

Writes ``<out>/<name>.json`` (main process) with the per-step reward, IS ratio and staleness, so the test can check
that the reward rises, that sampler and trainer log-probs agree right after every weight load (k = 0), and that
staleness never exceeds k; and ``<out>/k<k>.rank<i>.json`` (every process): where it sits, whether it built an
engine and a generator, and the loss tokens of its share of every batch. With ``--save``, a checkpoint at the last
step (under ``<out>/trainer_k<k>``) and the final model (``<out>/final_k<k>``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from transformers import AutoTokenizer, TrainerCallback

from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.envs import load_environment
from verifiers_rl.inference import EmbeddedEngine, SamplingConfig
from verifiers_rl.training.trainer import RLTrainer
from verifiers_rl.training.distributed import leave_process_group
from tests.distributed.equivalence_run import process_topology, rank_loss_tokens  # the repo root is on PYTHONPATH

TOY_ENV = str(Path(__file__).with_name("toy_env.py"))


class RankLossTokens(TrainerCallback):
    """Loss tokens in this rank's share of every batch."""

    def __init__(self):
        self.trainer = None
        self.per_step: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.per_step.append(rank_loss_tokens(self.trainer))


def run(model: str, k: int, steps: int, out: Path, env: str, env_args: dict, timeout_s: float, extra: dict,
        save: bool = False) -> None:
    args = RLConfig(
        output_dir=str(out / f"trainer_k{k}"), report_to="none", logging_steps=1,
        **({"save_strategy": "steps", "save_steps": steps} if save else {"save_strategy": "no"}),
        max_steps=steps, learning_rate=3e-3, lr_scheduler_type="constant", rollouts_per_step=32, num_generations=8,
        max_seq_len=64, max_off_policy_steps=k, loss_type="token_mean", gradient_checkpointing=False,
        disable_tqdm=True, seed=0, generation_timeout_s=timeout_s, **extra,
    )
    tokenizer = AutoTokenizer.from_pretrained(model)
    environment = load_environment(env, tokenizer=tokenizer, **env_args)
    # The engine lives on the main process only, with its own copy of the weights.
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8)
    engine = EmbeddedEngine(model, tokenizer, sampling, generate_in_loop_thread=k == 0) if args.process_index == 0 else None
    if engine is not None and not args.use_cpu:
        engine.model.to(args.device)  # as make_engine places it
    counter = RankLossTokens()
    trainer = RLTrainer(model, args, processing_class=tokenizer, environment=environment, engine=engine,
                        callbacks=[counter])
    counter.trainer = trainer
    trainer.train()
    if save:
        trainer.save_model(str(out / f"final_k{k}"))
    rank = trainer.accelerator.process_index
    rank_record = {**process_topology(trainer.accelerator), "engine": engine is not None,
                   "generator": trainer.generator is not None, "loss_tokens": counter.per_step}
    (out / f"k{k}.rank{rank}.json").write_text(json.dumps(rank_record))
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
    parser.add_argument("--ddp_timeout", type=int, default=None, help="RLConfig.ddp_timeout, when given")
    parser.add_argument("--save", action="store_true", help="a checkpoint at the last step, then the final model")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: tests/gpu, in fp32")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = {} if args.ddp_timeout is None else {"ddp_timeout": args.ddp_timeout}
    extra.update(use_cpu=args.device == "cpu", bf16=False)  # bf16 stated: RLConfig turns it on where CUDA is
    for k in args.k:
        run(args.model, k, args.steps, out, args.env, json.loads(args.env_args), args.timeout_s, extra, args.save)


if __name__ == "__main__":
    main()
    leave_process_group()
