"""Environments: datasets of tasks, rollout procedures and rubrics. They know nothing about training; they call a
``Sampler`` (an inference engine) and produce ``verifiers_rl.rollouts.Rollout`` records."""

from .environment import Environment, RolloutError, RolloutRefused, Row, Trajectory
from .loading import BUILTINS, DEFAULT_ENVIRONMENT, load_environment
from .math_check import MathChecker, correct_answer
from .multiturn import MultiTurnEnv, TemplateError
from .parsers import Parser, ThinkParser, XMLParser, extract_boxed_answer
from .rubric import Rubric, Score
from .sampler import RolloutSampling, Sample, Sampler, derive_seed, rollout_sampling, sampling_for_rollout
from .singleturn import SingleTurnEnv
from .tools import ToolEnv, parse_tool_calls

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
    "correct_answer",
    "derive_seed",
    "extract_boxed_answer",
    "load_environment",
    "parse_tool_calls",
    "rollout_sampling",
    "sampling_for_rollout",
]
