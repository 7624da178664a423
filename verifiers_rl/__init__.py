"""verifiers_rl: exact, asynchronous RL training of language models on pluggable environments.

    from verifiers_rl import RLConfig, RLTrainer, load_environment, EmbeddedEngine

Names load on first use (PEP 562): ``import verifiers_rl.inference.vllm_server`` runs where TRL is not installed.
"""

from __future__ import annotations

import importlib

# public name -> the module that defines it
_EXPORTS = {
    "RLTrainer": "trainer", "LossInputs": "step_loss", "CustomLoss": "step_loss",
    "RLConfig": "config",
    "Rollout": "rollouts", "read_rollouts": "rollouts", "write_rollouts": "rollouts",
    "Batch": "generator", "RolloutSource": "generator", "ReplaySource": "generator", "AsyncGenerator": "generator",
    "GenerationError": "generator", "GenerationTimeout": "generator",
    "Environment": "envs", "SingleTurnEnv": "envs", "MultiTurnEnv": "envs", "ToolEnv": "envs", "Rubric": "envs",
    "Parser": "envs", "XMLParser": "envs", "ThinkParser": "envs", "RolloutError": "envs", "load_environment": "envs",
    "InferenceEngine": "inference", "EmbeddedEngine": "inference", "VLLMEngine": "inference",
    "SamplingConfig": "inference",
    "TrainingPreempted": "preemption", "CheckpointError": "checkpoint", "WeightSyncError": "weights",
    "MainProcessError": "distributed",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'verifiers_rl' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
