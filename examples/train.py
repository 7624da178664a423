"""Train a policy with verifiers_rl.

    python examples/train.py --model tiny --rollouts_path rollouts.jsonl --loss_type dr_grpo
    accelerate launch --config_file accelerate_configs/ddp_cpu.yaml examples/train.py --rollouts_path rollouts.jsonl
    accelerate launch --config_file accelerate_configs/zero3.yaml examples/train.py --model Qwen/Qwen2.5-0.5B-Instruct ...
    python examples/train.py --config my_run.yaml

Every RLConfig / TrainingArguments field is a flag (``--help`` lists them); ``--config`` reads them from YAML.
The final model and tokenizer are saved to ``--output_dir``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import torch

# Without a GPU the script must ask for the CPU itself: a MULTI_GPU / DEEPSPEED launch would otherwise start
# processes that each train an independent copy (SPEC §7). The trainer also checks the world size.
if not torch.cuda.is_available():
    os.environ.setdefault("ACCELERATE_USE_CPU", "true")

from trl import TrlParser  # noqa: E402

from verifiers_rl.config import RLConfig  # noqa: E402
from verifiers_rl.models import load_tokenizer, resolve_model  # noqa: E402
from verifiers_rl.trainer import RLTrainer  # noqa: E402


@dataclass
class ScriptArguments:
    model: str = field(
        default="tiny",
        metadata={"help": "Hub id or local folder of a causal LM; 'tiny' builds a random tiny model offline."},
    )


def main(argv: list[str] | None = None) -> int:
    parser = TrlParser((ScriptArguments, RLConfig))
    script_args, config = parser.parse_args_and_config(args=argv)
    if not config.rollouts_path:
        parser.error("--rollouts_path is required: a JSON Lines file of rollouts to train on (SPEC §4 format).")
    model = resolve_model(script_args.model)
    trainer = RLTrainer(model=model, args=config, processing_class=load_tokenizer(model))
    trainer.train()
    trainer.save_model(config.output_dir)
    if trainer.accelerator.is_main_process:
        print(f"Saved the model and tokenizer to {config.output_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
