"""The choices and checks the config shares with the trainer, the loss and the engines.

They live below all of them, so the config never imports the training side (which imports the config).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, get_args

# The choices, as types (RLConfig's fields use them, so the CLI lists them) and as tuples.
LossType = Literal["grpo", "dr_grpo", "token_mean", "seq_mean_token_sum"]
ImportanceSamplingLevel = Literal["token", "sequence"]
CorrectionMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none"]
SequenceLogRatio = Literal["mean", "sum"]
LOSS_TYPES: tuple[str, ...] = get_args(LossType)
ScaleRewards = Literal["group", "batch", "none"]
OverlongPolicy = Literal["error", "truncate"]
MicroBatchingMode = Literal["padded", "packed"]
SharePromptTraining = Literal["auto", "on", "off"]


def check_choice(name: str, value, choices: tuple) -> None:
    """Raise ValueError naming the flag ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"Unknown {name} {value!r}; expected one of {', '.join(map(str, choices))}.")


def packed_row_fits(max_tokens_per_microbatch: int, max_seq_len: int) -> bool:
    """Whether a packed row holds the longest sequence."""
    return max_tokens_per_microbatch >= max_seq_len


def check_packed_row_fits(max_tokens_per_microbatch: int, max_seq_len: int) -> None:
    """A packed row must hold the longest sequence."""
    if not packed_row_fits(max_tokens_per_microbatch, max_seq_len):
        raise ValueError(
            f"max_tokens_per_microbatch ({max_tokens_per_microbatch}) must be >= max_seq_len ({max_seq_len}) so "
            "every sequence fits a packed row."
        )


RESERVED_TEMPLATE_KWARGS = ("conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                            "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
                            "padding", "truncation", "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs")


def check_chat_template_kwargs(kwargs: Any, flag: str = "chat_template_kwargs") -> dict[str, Any]:
    """``kwargs`` as the dict every chat template is rendered with (None: none); raises ValueError naming ``flag``
    for anything but a dict of string keys, or a key the renderers set themselves (``RESERVED_TEMPLATE_KWARGS``)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(key, str) for key in kwargs):
        raise ValueError(f"{flag} must be a dict of template variables (a JSON object on the command line), "
                         f"got {kwargs!r}.")
    reserved = sorted(set(kwargs) & set(RESERVED_TEMPLATE_KWARGS))
    if reserved:
        raise ValueError(f"{flag}: {reserved} are set by the environment's rendering itself, not template variables "
                         "it can pass on; give only the variables the chat template reads (e.g. enable_thinking).")
    return dict(kwargs)
