"""``chat_template_kwargs`` reach a real vLLM server's chat template (CPU): the engine ``build_engine`` makes from an
``RLConfig`` sends the config's, and the server's rendered prompt ids equal the local tokenizer's rendering with the
same kwargs. The served tiny model's template is Qwen3-like (``enable_thinking=False`` writes an empty think block)."""

from __future__ import annotations

import asyncio

from transformers import AutoTokenizer

from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.inference import VLLMEngine
from verifiers_rl.inference.factory import build_engine

MESSAGES = [{"role": "system", "content": "Reverse the text."}, {"role": "user", "content": "hello world"}]
THINK = "<think>\n\n</think>\n\n"


def local_ids(tokenizer, kwargs: dict) -> list[int]:
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs)
    return tokenizer(text, add_special_tokens=False).input_ids


def test_chat_renders_the_server_template_with_the_config_kwargs(untied, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(untied.model_dir)
    config = RLConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", vllm_server_url=untied.url,
                      max_completion_length=2, max_seq_len=256, chat_template_kwargs='{"enable_thinking": false}')
    engine = build_engine(config, untied.model_dir, tokenizer)
    plain = VLLMEngine(untied.url, model=untied.model_dir, check=False)
    try:
        assert isinstance(engine, VLLMEngine) and engine.chat_template_kwargs == {"enable_thinking": False}
        thinking_off = asyncio.run(engine.chat(MESSAGES, 2)).prompt_ids
        unchanged = asyncio.run(plain.chat(MESSAGES, 2)).prompt_ids
    finally:
        engine.close()
        plain.close()
    assert thinking_off == local_ids(tokenizer, {"enable_thinking": False})
    assert tokenizer.decode(thinking_off).endswith("<|im_start|>assistant\n" + THINK)
    assert unchanged == local_ids(tokenizer, {}) and THINK not in tokenizer.decode(unchanged)
