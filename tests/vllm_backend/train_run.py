"""examples/train.py, unchanged, plus one report line about the engine it trained with (main process only).

    accelerate launch --config_file accelerate_configs/ddp_cpu.yaml tests/vllm_backend/train_run.py \
        --model DIR --env reverse_text --max_steps 2 --vllm_server_url http://127.0.0.1:PORT ...

After training, the main process prints ``ENGINE_STATE {json}``: the engine's class, ``policy_version``,
``requests_served`` and its last weight load, which tests/vllm_backend/test_vllm_training.py checks.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    spec = importlib.util.spec_from_file_location("verifiers_rl_train_example", ROOT / "examples" / "train.py")
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example  # its dataclasses look their module up there
    spec.loader.exec_module(example)
    engines = []
    build = example.build_engine

    def recording_build_engine(*args, **kwargs):
        engine = build(*args, **kwargs)
        engines.append(engine)
        return engine

    example.build_engine = recording_build_engine  # main() looks the name up in its module at call time
    code = example.main(argv)
    for engine in engines:
        state = {
            "engine": type(engine).__name__,
            "policy_version": engine.policy_version,
            "requests_served": getattr(engine, "requests_served", None),
            "last_load": getattr(engine, "last_load", None),
            "health": engine.health(),
        }
        print("ENGINE_STATE " + json.dumps(state), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
