"""Environments: datasets of tasks, rollout procedures and rubrics. They know nothing about training; they call a
``Sampler`` (an inference engine) and produce ``verifiers_rl.core.rollout.Rollout`` records."""

from verifiers_rl.envs.awaitable import call_off_loop
from verifiers_rl.envs.environment import Environment, RolloutError, RolloutRefused, Row, Trajectory
from verifiers_rl.envs.loading import BUILTINS, DEFAULT_ENVIRONMENT, load_environment
from verifiers_rl.envs.math_check import MathChecker, correct_answer
from verifiers_rl.envs.multiturn import MultiTurnEnv, TemplateError
from verifiers_rl.envs.parsers import Parser, ThinkParser, XMLParser, extract_boxed_answer
from verifiers_rl.envs.rubric import Rubric, Score
from verifiers_rl.core.sampling import RolloutSampling, Sample, Sampler, derive_seed, rollout_sampling, sampling_for_rollout
from verifiers_rl.envs.singleturn import SingleTurnEnv
from verifiers_rl.envs.tools import ToolEnv, parse_tool_calls

__all__ = [
    "BUILTINS",
    "DEFAULT_ENVIRONMENT",
    "Environment",
    "MathChecker",
    "MultiTurnEnv",
    "Parser",
    "RolloutError",
    "RolloutRefused",
    "Row",
    "RolloutSampling",
    "Rubric",
    "Sample",
    "Sampler",
    "Score",
    "SingleTurnEnv",
    "TemplateError",
    "ThinkParser",
    "ToolEnv",
    "Trajectory",
    "XMLParser",
    "call_off_loop",
    "correct_answer",
    "derive_seed",
    "extract_boxed_answer",
    "load_environment",
    "parse_tool_calls",
    "rollout_sampling",
    "sampling_for_rollout",
]
