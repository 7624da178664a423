"""`verifiers-rl train` (verifiers_rl.cli.train, what examples/train.py runs), unchanged, plus one report line about the engine it trained with (main process only).

    accelerate launch --config_file accelerate_configs/ddp_cpu.yaml tests/vllm_backend/train_run.py \
        --model DIR --env reverse_text --max_steps 2 --vllm_server_url http://127.0.0.1:PORT ...

When main() closes the engine after training, the main process records its state; it then prints
``ENGINE_STATE {json}``: the engine's class, ``policy_version``, ``requests_served``, its last weight load and its
health, which tests/vllm_backend/test_vllm_training.py checks.
"""

from __future__ import annotations

import json
import sys

from verifiers_rl.cli import train as example


def main(argv: list[str] | None = None) -> int:
    engines = []
    build = example.build_engine

    def recording_build_engine(*args, **kwargs):
        engine = build(*args, **kwargs)
        close = engine.close

        def close_after_recording() -> None:
            # main() closes the engine when training ends: record what it answered then, before the close.
            engines.append(engine_state(engine))
            close()

        engine.close = close_after_recording
        return engine

    example.build_engine = recording_build_engine  # main() looks the name up in its module at call time
    code = example.main(argv)
    for state in engines:
        print("ENGINE_STATE " + json.dumps(state), flush=True)
    return code


def engine_state(engine) -> dict:
    return {
        "engine": type(engine).__name__,
        "policy_version": engine.policy_version,
        "requests_served": getattr(engine, "requests_served", None),
        "last_load": getattr(engine, "last_load", None),
        "recoveries": getattr(engine, "recoveries", None),
        "resent_requests": getattr(engine, "resent_requests", None),
        "health": engine.health(),
    }


if __name__ == "__main__":
    sys.exit(main())
