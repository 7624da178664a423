"""Pick the inference engine a run generates with: training (``build_engine``, from its config) and evaluation
(``verifiers-rl eval``) both go through ``make_engine``."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from verifiers_rl.core.engine import SamplingConfig
from verifiers_rl.core.models import WHICH_WEIGHTS
from verifiers_rl.core.settings import keywords, settings_from
from verifiers_rl.inference.vllm.http import SERVER_WAIT_S, server_urls

logger = logging.getLogger(__name__)


def make_engine(model, tokenizer, sampling: SamplingConfig, *, vllm_server_url: str | None = None,
                vllm: dict[str, Any] | None = None, require_weight_sync: bool = True,
                generate_in_loop_thread: bool = False, max_batch_size: int = 64, dtype: torch.dtype = torch.float32,
                continuous_rows: int = 0, load_kwargs: dict | None = None):
    """A ``VLLMEngine`` client of ``vllm_server_url`` (a ``MultiServerEngine`` when it names several; checked now: it
    must answer and serve ``model``; a server still starting gets ``vllm``'s ``wait_s``, else ``SERVER_WAIT_S``;
    ``vllm``: its other arguments), or the embedded HF engine on its own copy of ``model``'s weights, on the GPU
    when there is one (``generate`` follows the embedding's device), serving continuously with ``continuous_rows``
    (``EmbeddedEngine``, loading a name/folder with ``load_kwargs``; a server batches continuously itself and refuses
    it)."""
    urls = server_urls(vllm_server_url)
    if urls and continuous_rows:
        raise ValueError(f"continuous_rows={continuous_rows} (--continuous_batching_rows) sets the embedded engine's "
                         "running batch; a vLLM server already batches continuously. Leave it 0.")
    client = {"wait_s": SERVER_WAIT_S, **(vllm or {})}
    if len(urls) > 1:
        from verifiers_rl.inference.vllm.pool import MultiServerEngine

        return MultiServerEngine(urls, model=model, sampling=sampling, require_weight_sync=require_weight_sync,
                                 **client)
    if vllm_server_url:
        from verifiers_rl.inference.vllm.engine import VLLMEngine

        return VLLMEngine(urls[0], model=model, sampling=sampling, require_weight_sync=require_weight_sync,
                          **client)
    from verifiers_rl.inference.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine(model, tokenizer, sampling, max_batch_size=max_batch_size, dtype=dtype,
                            generate_in_loop_thread=generate_in_loop_thread, continuous_rows=continuous_rows,
                            load_kwargs=load_kwargs)
    if torch.cuda.is_available():
        engine.model.to("cuda")
    elif continuous_rows and os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        logger.warning(
            "--continuous_batching_rows on the CPU: the decode thread and training each run an OpenMP team, and "
            "OpenMP's idle threads spin by default, taking the cores from the other. Start the run with "
            "OMP_WAIT_POLICY=PASSIVE in its environment (read when torch loads), so idle threads sleep.")
    return engine


def check_given_engine_rows(config, engine) -> None:
    """An engine given to ``RLTrainer`` (``engine=``) decodes as it was built: ``config``'s
    ``continuous_batching_rows``, set and not what the engine was built with, is refused by name (accepted, it would
    change nothing)."""
    rows, built = config.continuous_batching_rows, getattr(engine, "continuous_rows", 0)
    if engine is not None and rows and built != rows:
        raise ValueError(f"--continuous_batching_rows {rows} sets the running batch of the engine the trainer builds; "
                         f"the engine given to RLTrainer (engine=) was built with continuous_rows={built} and decodes "
                         f"as built, so it would change nothing. Build it with EmbeddedEngine(..., continuous_rows="
                         f"{rows}), or leave continuous_batching_rows 0.")


# The sampling knobs an engine's SamplingConfig and the run's config both set (max_new_tokens is each call's own).
SAMPLING_KNOBS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def check_given_engine_sampling(config, engine) -> None:
    """An engine given to ``RLTrainer`` (``engine=``) samples as its own ``SamplingConfig`` says, while the trainer
    computes its log-probs (and the importance correction) at ``config``'s ``temperature``: a knob on which the two
    disagree is refused, naming both values (accepted, the run would train what it did not sample)."""
    built = getattr(engine, "sampling", None)
    if not isinstance(built, SamplingConfig):  # an engine of the user's own, without our sampling settings
        return
    wanted = sampling_settings(config)
    differ = [name for name in SAMPLING_KNOBS if getattr(built, name) != getattr(wanted, name)]
    if differ:
        said = ", ".join(f"--{name} {getattr(wanted, name)} but the engine's {getattr(built, name)}" for name in differ)
        raise ValueError(f"The engine given to RLTrainer (engine=) samples otherwise than the run's config says: "
                         f"{said}. Build the engine with the config's (SamplingConfig: "
                         "verifiers_rl.inference.factory.sampling_settings(config)), or set those flags to the "
                         "engine's values.")


def sampling_settings(config) -> SamplingConfig:
    """The engine's ``SamplingConfig`` from ``config`` (an ``RLConfig``: its ``generation_kwargs`` are already written
    into these fields; TRL's ``top_k`` / ``min_p`` None is off)."""
    return settings_from(config, SamplingConfig, top_k=config.top_k or 0, min_p=config.min_p or 0.0)


@dataclass(frozen=True)
class VLLMSettings:
    """A vLLM client's settings from the config (``make_engine``'s ``vllm``; ``VLLMEngine``'s keywords)."""

    max_concurrency: int = field(default=64, metadata={"from": "vllm_max_concurrency"})
    request_timeout_s: float = field(default=600.0, metadata={"from": "vllm_request_timeout_s"})
    max_retries: int = field(default=3, metadata={"from": "vllm_max_retries"})
    reconnect_timeout_s: float = field(default=0.0, metadata={"from": "vllm_reconnect_timeout_s"})
    weights_dir: str | None = field(default=None, metadata={"from": "vllm_weights_dir"})
    weight_transfer: str = field(default="files", metadata={"from": "vllm_weight_transfer"})
    weight_transfer_address: str | None = field(default=None, metadata={"from": "vllm_weight_transfer_address"})
    weight_transfer_bucket_mb: float = field(default=256.0, metadata={"from": "weight_sync_bucket_mb"})
    wait_s: float = field(default=SERVER_WAIT_S, metadata={"from": "vllm_server_timeout"})
    chat_template_kwargs: dict | None = None  # what its chat() asks the server's template for
    token_versions: bool = False  # continuous generation (--groups_in_flight): each token's version, exactly
    max_seq_len: int | None = None  # a server must take sequences this long (its --max-model-len)


def vllm_settings(config) -> VLLMSettings:
    """The vLLM client's settings from ``config`` (an ``RLConfig``)."""
    # 0 (one tensor per gather) would make one HTTP round per tensor: keep rounds of a few MiB at least.
    return settings_from(config, VLLMSettings, weight_transfer_bucket_mb=max(config.weight_sync_bucket_mb, 4.0),
                         token_versions=config.groups_in_flight > 0)


def build_engine(config, model: str, tokenizer):
    """The engine for ``config`` (an ``RLConfig``), built on the main process only: its sampling settings, and with
    ``vllm_server_url`` a client that accepts weight loads as the config's transfer says."""
    # The embedded engine samples in the training precision (bf16 on a GPU by default), as TRL's generate and a
    # vLLM server do; the importance weights correct what rounding differs.
    dtype = torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else torch.float32
    # k = 0 generates on the trainer's thread (AsyncGenerator), and generate() then stays on it too.
    return make_engine(model, tokenizer, sampling_settings(config), vllm_server_url=config.vllm_server_url,
                       vllm=keywords(vllm_settings(config)), generate_in_loop_thread=config.max_off_policy_steps == 0,
                       dtype=dtype, continuous_rows=config.continuous_batching_rows,
                       load_kwargs=model_load_kwargs(config))


def model_load_kwargs(config) -> dict[str, Any]:
    """What of ``config``'s model loading (``model_init_kwargs``, ``trust_remote_code``) the engine loads with too."""
    given = {"trust_remote_code": config.trust_remote_code, **(config.model_init_kwargs or {})}
    return {key: value for key, value in given.items() if key in WHICH_WEIGHTS}
