"""verifiers-rl: one command with a subcommand per job.

    verifiers-rl train [FLAGS]        train (verifiers_rl.cli.train; `accelerate launch -m verifiers_rl.cli.train`)
    verifiers-rl eval [FLAGS]         evaluate a model or checkpoint on an environment's held-out split
    verifiers-rl vllm-serve [FLAGS]   start a vLLM server for training or evaluation (--then COMMAND runs one beside it)
    verifiers-rl fields               what each of TRL's GRPOConfig fields does here (acts, or refused and why)
    verifiers-rl config               the configuration reference by section (docs/config.md)
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, its entry point); imported only when chosen, so `verifiers-rl --help` answers at once.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("verifiers_rl.cli.train", "main"),
    "eval": ("verifiers_rl.cli.eval", "cli"),
    "vllm-serve": ("verifiers_rl.inference.vllm.server", "main"),
    "fields": ("verifiers_rl.cli.main", "print_fields"),
    "config": ("verifiers_rl.cli.sections", "main"),
}


def print_fields(argv: list[str]) -> int:
    from verifiers_rl.config.grpo_fields import markdown_table

    if argv in (["-h"], ["--help"]):
        print("verifiers-rl fields: what each of TRL's GRPOConfig fields does here (acts, or refused and why), as a "
              "markdown table (docs/trl.md).")
        return 0
    if argv:
        print(f"verifiers-rl fields takes no arguments, got {' '.join(argv)}", file=sys.stderr)
        return 2
    print(markdown_table())
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"verifiers-rl: unknown command {command!r}; choose one of {', '.join(COMMANDS)} "
              "(verifiers-rl --help).", file=sys.stderr)
        return 2
    module, function = COMMANDS[command]
    return getattr(importlib.import_module(module), function)(rest)


if __name__ == "__main__":
    sys.exit(main())
