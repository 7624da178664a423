"""Train a policy with verifiers_rl: the same command as ``verifiers-rl train`` (every flag: ``--help``).

    python examples/train.py                                                 # the CPU quickstart
    python examples/train.py --model tiny --env reverse_text --max_steps 50  # live generation (embedded engine)
    python examples/train.py --model tiny --rollouts_path rollouts.jsonl     # replay
    accelerate launch --config_file accelerate_configs/ddp_cpu.yaml examples/train.py --rollouts_path rollouts.jsonl

What the command does, through the library (``verifiers_rl.cli.train.main``): parse ``RLConfig`` and the script's
flags (``--config`` YAML first, then the command line), load the environment and make it ready
(``verifiers_rl.envs.prepare.prepare_environment``: chat template kwargs, the length contract, the held-out split),
build the inference engine on the main process (``verifiers_rl.inference.factory.build_engine``), then
``RLTrainer(model=..., args=config, environment=..., engine=...).train()`` and save the model.
"""

import sys

from verifiers_rl.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
