"""Train a policy with verifiers_rl.

    python examples/train.py --model tiny --env reverse_text --max_steps 50       # live generation (embedded engine)
    python examples/train.py --env my_pkg.my_env:load_environment --env_args '{"num_examples": 100}'
    python examples/train.py --model tiny --rollouts_path rollouts.jsonl --loss_type dr_grpo   # replay
    accelerate launch --config_file accelerate_configs/ddp_cpu.yaml examples/train.py --rollouts_path rollouts.jsonl
    accelerate launch --config_file accelerate_configs/zero3.yaml examples/train.py --model Qwen/Qwen2.5-0.5B-Instruct ...
    python examples/train.py --config my_run.yaml

Every RLConfig / TrainingArguments field is a flag (``--help`` lists them); ``--config`` reads them from YAML.
The final model and tokenizer are saved to ``--output_dir``.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

import torch

# Without a GPU the script must ask for the CPU itself: a MULTI_GPU / DEEPSPEED launch would otherwise start
# processes that each train an independent copy (SPEC §7). The trainer also checks the world size.
if not torch.cuda.is_available():
    os.environ.setdefault("ACCELERATE_USE_CPU", "true")

from trl import TrlParser  # noqa: E402

from accelerate import PartialState  # noqa: E402

from verifiers_rl.config import RLConfig  # noqa: E402
from verifiers_rl.envs import DEFAULT_ENVIRONMENT, load_environment  # noqa: E402
from verifiers_rl.inference.factory import build_engine  # noqa: E402
from verifiers_rl.models import load_tokenizer, resolve_model  # noqa: E402
from verifiers_rl.trainer import RLTrainer  # noqa: E402


@dataclass
class ScriptArguments:
    model: str = field(
        default="tiny",
        metadata={"help": "Hub id or local folder of a causal LM; 'tiny' builds a random tiny model offline."},
    )
    env: str = field(
        default=DEFAULT_ENVIRONMENT,
        metadata={"help": "Environment to generate from (unless --rollouts_path): a built-in name, "
                  "'pkg.module:function', or a .py file defining load_environment(**kwargs)."},
    )
    env_args: str = field(default="{}", metadata={"help": "JSON keyword arguments for the environment's loader."})


def main(argv: list[str] | None = None) -> int:
    parser = TrlParser((ScriptArguments, RLConfig))
    script_args, config = parser.parse_args_and_config(args=argv)
    try:
        env_args = json.loads(script_args.env_args)
    except json.JSONDecodeError as error:
        parser.error(f"--env_args is not valid JSON: {error}")
    model = resolve_model(script_args.model)
    tokenizer = load_tokenizer(model)
    live = {}
    if not config.rollouts_path:
        environment = load_environment(script_args.env, tokenizer=tokenizer, **env_args)
        # The engine (its own copy of the weights, or a client of a server) lives on the main process only.
        engine = build_engine(config, model, tokenizer) if PartialState().is_main_process else None
        live = {"environment": environment, "engine": engine}
    trainer = RLTrainer(model=model, args=config, processing_class=tokenizer, **live)
    trainer.train()
    trainer.save_model(config.output_dir)
    if trainer.accelerator.is_main_process:
        print(f"Saved the model and tokenizer to {config.output_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
