"""verifiers_rl's exact turn bridge (``verifiers_rl/envs/turns.py``) offered to verifiers 0.4 as a renderer, for
chat templates that have no renderer of their own in the ``renderers`` package (SmolLM2's, the tiny model's).

For those, v1's ``DefaultRenderer.bridge_to_next_turn`` returns ``None``, so v1's train client re-tokenises the
whole conversation at every turn; a reply that does not tokenise back to its sampled ids then forks the episode
into a new branch. ``ExactBridgeRenderer`` keeps the sampled ids verbatim and appends the template's tokens for
the environment's new messages, as ``MultiTurnEnv`` does for classic environments: one token sequence per
episode, whose model tokens are exactly the sampled ones. The episode worker names it in
``TrainClientConfig.renderer`` as a ``CustomRendererConfig`` (v1's hook for renderers outside its package).

Runs in the verifiers 0.4 venv, where verifiers_rl is not installed: ``turns.py`` (standard library only) is
loaded from its file.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from renderers import DefaultRendererConfig, RenderedTokens
from renderers.base import extract_message_tool_names
from renderers.default import DefaultRenderer

TURNS_FILE = Path(__file__).resolve().parents[1] / "envs" / "turns.py"


def _load_turns():
    spec = importlib.util.spec_from_file_location("verifiers_rl_turns", TURNS_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


turns = _load_turns()


class ExactBridgeRenderer(DefaultRenderer):
    """v1's ``DefaultRenderer`` (``apply_chat_template``), whose ``bridge_to_next_turn`` extends the previous
    turn's ids with ``turns.bridge_ids`` instead of declining. It declines (``None``: v1 re-renders) where v1's
    contract says to, for assistant messages among the new ones, and where the template cannot be extended turn
    by turn (``turns.TemplateError``)."""

    config_class = DefaultRendererConfig

    def bridge_to_next_turn(self, previous_prompt_ids: list[int], previous_completion_ids: list[int],
                            new_messages: list[dict[str, Any]], *, tools: list[dict] | None = None
                            ) -> RenderedTokens | None:
        if not previous_completion_ids or any(m.get("role") == "assistant" for m in new_messages):
            return None

        def render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
            return self._tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
                **dict(self.config.model_extra or {}))

        try:
            tail = turns.bridge_ids(render, self.encode, previous_completion_ids[-1:], list(new_messages),
                                    "verifiers_rl's turn bridge")
        except turns.TemplateError:
            return None
        token_ids = [*previous_prompt_ids, *previous_completion_ids, *tail]
        # All -1 (outside any message): exact ids matter here, not which message each bridged token belongs to;
        # v1 then files the bridged tokens with the next assistant node, unsampled.
        return RenderedTokens(token_ids=token_ids, message_indices=[-1] * len(token_ids),
                              message_roles=[m.get("role") or "" for m in new_messages],
                              message_tool_names=extract_message_tool_names(new_messages))

    def encode(self, text: str) -> list[int]:
        return self._tokenizer(text, add_special_tokens=False)["input_ids"]
