"""Pick the inference engine a training run generates with, from its config."""

from __future__ import annotations

from .engine import SamplingConfig
from .hf_engine import EmbeddedEngine


def build_engine(config, model: str, tokenizer):
    """The engine for ``config`` (an ``RLConfig``), built on the main process only: the embedded HF engine on its
    own copy of ``model``'s weights."""
    sampling = SamplingConfig(temperature=config.temperature, max_new_tokens=config.max_completion_length)
    return EmbeddedEngine(model, tokenizer, sampling)
