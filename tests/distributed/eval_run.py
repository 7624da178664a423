"""One launch (any backend) of a replay run (or, with ``--live``, a live run) trained twice, without and with
evaluation every step.

Evaluation of a replay run loads the trainer's weights into an engine on the main process first (under ZeRO-3 a
collective gather). Writes, on the main process, ``params_<name>.pt`` (the final weights, gathered), ``<name>.json``
(the log history and the number of processes) and, for the evaluated run, the saved model in ``saved/``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoTokenizer

from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.envs import load_environment
from verifiers_rl.inference import EmbeddedEngine, SamplingConfig
from verifiers_rl.training.trainer import RLTrainer
from verifiers_rl.training.distributed import leave_process_group

ENV_ARGS = {"num_examples": 16, "num_eval_examples": 4, "max_new_tokens": 8}


def run(model: str, rollouts: str | None, out: Path, evaluating: bool) -> None:
    name = "eval" if evaluating else "plain"
    args = RLConfig(
        output_dir=str(out / "trainer" / name), use_cpu=True, report_to="none", save_strategy="no", logging_steps=1,
        max_steps=2, learning_rate=1e-2, lr_scheduler_type="constant", max_seq_len=128, rollouts_per_step=8,
        rollouts_path=rollouts, num_generations=4, micro_batching="padded", gradient_checkpointing=False, disable_tqdm=True, seed=0,
        **({"eval_steps": 1, "eval_samples_per_prompt": 2} if evaluating else {}),
    )
    tokenizer = AutoTokenizer.from_pretrained(model)
    environment = load_environment("reverse_text", tokenizer=tokenizer, **ENV_ARGS)
    main = args.process_index == 0
    engine = EmbeddedEngine(model, tokenizer, SamplingConfig(max_new_tokens=8)) if main else None
    # Live: the environment trains too (generation and evaluation share the engine); replay: it only evaluates.
    sources = {"eval_environment": environment} if rollouts else {"environment": environment}
    trainer = RLTrainer(model, args, processing_class=tokenizer, engine=engine, **sources)
    trainer.train()
    params = {key: tensor.clone() for key, tensor in trainer.named_weights()}  # every rank takes part in the gathers
    if evaluating:
        trainer.save_model(str(out / "saved"))
    if main:
        torch.save(params, out / f"params_{name}.pt")
        record = {"log_history": trainer.state.log_history, "num_processes": trainer.accelerator.num_processes}
        (out / f"{name}.json").write_text(json.dumps(record))
    trainer.accelerator.wait_for_everyone()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--rollouts", default=None, help="replay this file (default: a live run)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for evaluating in (False, True):
        run(args.model, args.rollouts, out, evaluating)


if __name__ == "__main__":
    main()
    leave_process_group()
