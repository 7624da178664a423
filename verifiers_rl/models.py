"""Load a model and tokenizer: a hub id or local folder, or a tiny model built offline for tests and smoke runs."""

from __future__ import annotations

import os
from pathlib import Path

TINY_CORPUS = [
    "What is 2 + 2? The answer is 4.",
    "Reverse the text: hello world -> dlrow olleh",
    "The quick brown fox jumps over the lazy dog.",
    "<think>Let me compute 17 * 3 = 51.</think> The answer is \\boxed{51}.",
    "Guess a number between 1 and 100. Too high! Too low! Correct!",
    "calculator(expression='12 / 4') returned 3.0",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ?",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_model(
    output_dir: str | Path,
    *,
    seed: int = 0,
    vocab_size: int = 400,
    hidden_size: int = 64,
    num_layers: int = 2,
    tie_word_embeddings: bool = True,
) -> Path:
    """Train a byte-level BPE tokenizer on a small corpus and save a random Llama model beside it.

    A Llama config (not Qwen2): transformers swaps Qwen2's own pre-tokenizer in at load time, which would change
    the ids. Heads of size 32, so the same folder also loads in vLLM on CPU.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer.train_from_iterator(
        TINY_CORPUS * 4,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
        padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=max(hidden_size // 32, 1),
        num_key_value_heads=max(hidden_size // 32, 1),
        max_position_embeddings=2048,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=fast.pad_token_id,
        eos_token_id=fast.eos_token_id,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = fast.pad_token_id
    model.generation_config.eos_token_id = fast.eos_token_id
    fast.save_pretrained(output_dir)
    model.save_pretrained(output_dir)
    return output_dir


def default_tiny_model_dir() -> Path:
    cache = Path(os.environ.get("VERIFIERS_RL_CACHE", Path.home() / ".cache" / "verifiers_rl"))
    return cache / "tiny-llama"


def resolve_model(name_or_path: str) -> str:
    """``tiny`` builds (once) and returns the offline tiny model; anything else is passed to transformers."""
    if name_or_path == "tiny":
        folder = default_tiny_model_dir()
        if not (folder / "config.json").is_file():
            build_tiny_model(folder)
        return str(folder)
    return name_or_path


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(name_or_path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
