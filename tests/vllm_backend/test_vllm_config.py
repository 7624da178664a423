"""RLConfig's vLLM fields: TRL's own vLLM switches are refused with a pointer to ours (no server needed)."""

from __future__ import annotations

import pytest

from verifiers_rl.config import RLConfig


def config(**kwargs) -> RLConfig:
    return RLConfig(output_dir="/tmp/unused", report_to="none", **kwargs)


def test_trl_vllm_switches_point_to_vllm_server_url():
    for kwargs in ({"use_vllm": True}, {"vllm_server_base_url": "http://127.0.0.1:8000"}):
        with pytest.raises(ValueError, match="--vllm_server_url http://HOST:PORT"):
            config(**kwargs)


def test_vllm_fields_are_validated():
    assert config(vllm_server_url="http://127.0.0.1:8000").vllm_server_url == "http://127.0.0.1:8000"
    with pytest.raises(ValueError, match="vllm_server_url must start with http"):
        config(vllm_server_url="127.0.0.1:8000")
    with pytest.raises(ValueError, match="vllm_max_concurrency must be >= 1"):
        config(vllm_max_concurrency=0)
    with pytest.raises(ValueError, match="vllm_request_timeout_s must be > 0"):
        config(vllm_request_timeout_s=0)
    with pytest.raises(ValueError, match="vllm_max_retries must be >= 0"):
        config(vllm_max_retries=-1)
    with pytest.raises(ValueError, match="Unknown vllm_weight_transfer .tcp.; expected one of files, nccl, gloo"):
        config(vllm_weight_transfer="tcp")
