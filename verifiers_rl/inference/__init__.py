"""Inference engines: one small interface, an embedded HF engine, and a vLLM server client."""

from .engine import EngineClosedError, InferenceEngine, Sample, SamplingConfig
from .hf_engine import EmbeddedEngine
from .vllm_engine import ChatSample, VLLMEngine, VLLMError  # HTTP only: never imports vllm

__all__ = [
    "ChatSample",
    "EmbeddedEngine",
    "EngineClosedError",
    "InferenceEngine",
    "Sample",
    "SamplingConfig",
    "VLLMEngine",
    "VLLMError",
]
