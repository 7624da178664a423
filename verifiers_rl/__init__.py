"""verifiers_rl: exact, asynchronous RL training of language models on pluggable environments.

    from verifiers_rl import RLConfig, RLTrainer, load_environment, EmbeddedEngine
    from verifiers_rl import GRPOConfig, GRPOTrainer     # TRL's names for RLConfig and RLTrainer

Names load on first use (PEP 562): ``import verifiers_rl.inference.vllm.server`` runs where TRL is not installed.
"""

from __future__ import annotations

import importlib

# public name -> the module that defines it
_EXPORTS = {
    "RLTrainer": "training.trainer", "LossInputs": "training.step_loss", "CustomLoss": "training.step_loss",
    "RLConfig": "config.rl_config",
    "Rollout": "core.rollout", "read_rollouts": "core.rollout", "write_rollouts": "core.rollout",
    "Batch": "rollouts.generator", "RolloutSource": "rollouts.generator", "ReplaySource": "rollouts.generator",
    "AsyncGenerator": "rollouts.generator", "GenerationError": "rollouts.generator",
    "GenerationTimeout": "rollouts.generator",
    "Environment": "envs", "SingleTurnEnv": "envs", "MultiTurnEnv": "envs", "ToolEnv": "envs", "Rubric": "envs",
    "Parser": "envs", "XMLParser": "envs", "ThinkParser": "envs", "RolloutError": "envs", "load_environment": "envs",
    "mixture_of": "envs.mixture", "MixtureEnv": "envs.mixture", "RewardFunctionsEnv": "envs.adapters.trl_dataset",
    "InferenceEngine": "inference", "EmbeddedEngine": "inference", "VLLMEngine": "inference",
    "SamplingConfig": "inference",
    "TrainingPreempted": "training.preemption", "CheckpointError": "core.errors",
    "WeightSyncError": "training.weight_stream", "MainProcessError": "training.distributed",
}
# TRL's names for ours: a TRL script changes only its import (docs/trl.md).
_ALIASES = {"GRPOTrainer": "RLTrainer", "GRPOConfig": "RLConfig"}

__all__ = sorted([*_EXPORTS, *_ALIASES])


def __getattr__(name: str):
    target = _ALIASES.get(name, name)
    if target not in _EXPORTS:
        raise AttributeError(f"module 'verifiers_rl' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[target]}", __name__), target)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
