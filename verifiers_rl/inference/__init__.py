"""Inference engines: one small interface, an embedded HF engine, and a vLLM server client."""

from verifiers_rl.core.engine import EngineClosedError, InferenceEngine, Sample, SamplingConfig
from verifiers_rl.inference.embedded.engine import EmbeddedEngine
from verifiers_rl.inference.vllm.engine import ChatSample, VLLMEngine, VLLMError  # HTTP only: never imports vllm

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
