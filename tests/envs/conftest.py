import copy

import pytest

from .templates import TOOL_TEMPLATE


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    """The tiny test tokenizer: byte-level BPE trained locally, ChatML chat template (no tool support), eos <|im_end|>."""
    from transformers import AutoTokenizer

    from verifiers_rl.core.models import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("envs-tiny")))


@pytest.fixture(scope="session")
def tool_tokenizer(tokenizer):
    """The tiny test tokenizer with a ChatML template that supports tools."""
    tool_tokenizer = copy.deepcopy(tokenizer)
    tool_tokenizer.chat_template = TOOL_TEMPLATE
    return tool_tokenizer
