"""Pick the inference engine a training run generates with, from its config."""

from __future__ import annotations

from .engine import SamplingConfig


def build_engine(config, model: str, tokenizer):
    """The engine for ``config`` (an ``RLConfig``), built on the main process only.

    With ``vllm_server_url``: a ``VLLMEngine`` client of that server, checked now (it must answer, serve ``model``
    and accept weight loads; a server still starting gets 30 s). Otherwise the embedded HF engine on its own copy
    of ``model``'s weights.
    """
    sampling = SamplingConfig(
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k or 0,
        max_new_tokens=config.max_completion_length,
    )
    if getattr(config, "vllm_server_url", None):
        from .vllm_engine import VLLMEngine

        return VLLMEngine(
            config.vllm_server_url,
            model=model,
            sampling=sampling,
            max_concurrency=config.vllm_max_concurrency,
            request_timeout_s=config.vllm_request_timeout_s,
            max_retries=config.vllm_max_retries,
            weights_dir=config.vllm_weights_dir,
            weight_transfer=config.vllm_weight_transfer,
            weight_transfer_address=config.vllm_weight_transfer_address,
            # 0 (one tensor per gather) would make one HTTP round per tensor: keep rounds of a few MiB at least.
            weight_transfer_bucket_mb=max(config.weight_sync_bucket_mb, 4.0),
            wait_s=30.0,
        )
    from .hf_engine import EmbeddedEngine

    # k = 0 generates on the trainer's thread (AsyncGenerator), and generate() then stays on it too.
    return EmbeddedEngine(model, tokenizer, sampling, generate_in_loop_thread=config.max_off_policy_steps == 0)
