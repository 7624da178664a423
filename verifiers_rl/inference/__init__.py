"""Inference engines (SPEC §5): one small interface, an embedded HF engine, and (later) a vLLM client."""

from .engine import InferenceEngine, Sample, SamplingConfig
from .hf_engine import EmbeddedEngine, EngineClosedError

__all__ = ["EmbeddedEngine", "EngineClosedError", "InferenceEngine", "Sample", "SamplingConfig"]
