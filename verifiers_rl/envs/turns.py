"""The tokens between two model turns of a multi-turn rollout, without re-tokenising what the model sampled.

A rollout's token sequence is built incrementally: prompt ids, each sample's ids verbatim (trained), and between two
samples the environment's ids (not trained): the rest of the template's end-of-turn that the model did not emit
itself, the environment's new messages and the next generation prompt. Those are rendered after a stand-in assistant
turn (itself after a stand-in user turn where the template refuses to open with an assistant turn), so the model's
own turn is never re-rendered (a template that rewrites earlier assistant turns, e.g. dropping their reasoning,
cannot change the tokens already sampled). ``MultiTurnEnv`` and the verifiers adapter's client both
use ``bridge_ids``.
"""

from __future__ import annotations

from typing import Any, Callable

# Stands in for an assistant message's content to locate the template's end-of-turn text after it.
CONTENT_PROBE = "\x00verifiers_rl-content\x00"

Render = Callable[[list[dict[str, Any]], bool], str]  # (messages, add_generation_prompt) -> text


class TemplateError(ValueError):
    """The chat template cannot be extended turn by turn (it renders earlier turns differently)."""


def bridge_ids(render: Render, encode: Callable[[str], list[int]], last_sampled: list[int],
               new: list[dict[str, Any]], name: str) -> list[int]:
    """Token ids after a model turn whose last sampled token is ``last_sampled``: the rest of the template's
    end-of-turn, the ``new`` messages and the next generation prompt.

    = end_of_turn (less its first token if the model sampled it, its eos) + render(stand_in + new)[len(render(stand_in)):]
    """
    lead = _lead(render)
    plain_turn = render([*lead, {"role": "assistant", "content": CONTENT_PROBE}], False)
    if CONTENT_PROBE not in plain_turn:
        raise TemplateError(f"{name}: the chat template does not render an assistant message's content verbatim.")
    end_of_turn = encode(plain_turn.rsplit(CONTENT_PROBE, 1)[1])
    if end_of_turn[:1] == last_sampled:
        end_of_turn = end_of_turn[1:]  # the model emitted the template's end-of-turn token (its eos) itself
    stand_in: dict[str, Any] = {"role": "assistant", "content": CONTENT_PROBE}
    tool_call_ids = [m.get("tool_call_id") for m in new if m.get("role") == "tool"]
    if tool_call_ids:  # some templates check that tool results follow an assistant turn with tool calls
        stand_in["tool_calls"] = [
            {"id": i, "type": "function", "function": {"name": "f", "arguments": {}}} for i in tool_call_ids
        ]
    base = encode(render([*lead, stand_in], False))
    full = encode(render([*lead, stand_in, *new], True))
    if full[: len(base)] != base:
        raise TemplateError(
            f"{name}: the chat template is not prefix-consistent: it renders an assistant turn differently once "
            "messages follow it, so the environment's messages cannot be appended to the sampled tokens. Use a "
            "template that renders earlier turns identically."
        )
    return end_of_turn + full[len(base) :]


def _lead(render: Render) -> list[dict[str, Any]]:
    """What the stand-in assistant turn follows: nothing, or a user turn where the template refuses a conversation
    opening with an assistant turn (Gemma's, Mistral's: roles must alternate from a user turn). Nothing where it can:
    a user turn would change how some templates render the stand-in (Qwen3's, after the last user turn)."""
    try:
        render([{"role": "assistant", "content": CONTENT_PROBE}], False)
        return []
    except Exception:  # noqa: BLE001 - the template's own error (jinja's raise_exception); the lead is retried below
        return [{"role": "user", "content": "?"}]
