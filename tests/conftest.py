import os
import warnings

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random tiny Llama with a locally trained tokenizer (no hub)."""
    from verifiers_rl.models import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(autouse=True)
def _quiet_known_warnings():
    # transformers 5 deprecations that TRL still triggers; not ours to fix.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*", category=FutureWarning)
        yield
