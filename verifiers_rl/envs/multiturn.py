"""MultiTurnEnv: model turns and environment turns alternate; the trained tokens are exactly the sampled tokens.

The token sequence is built incrementally, never re-tokenised: prompt ids, then each sample's ids verbatim
(mask 1), then the environment's ids (mask 0): the template's end-of-turn that the model did not emit itself, and
the rendering of the conversation with the new messages and the next generation prompt minus the rendering of
the conversation so far. That difference exists only for a prefix-consistent chat template, which is checked.
"""

from __future__ import annotations

from typing import Any

from .awaitable import maybe_await
from .environment import Environment, Trajectory
from .messages import Messages, check_messages
from .sampler import Sampler

# Stands in for an assistant message's content to locate the template's end-of-turn text after it.
_CONTENT_PROBE = "\x00verifiers_rl-content\x00"


class TemplateError(ValueError):
    """The chat template cannot be extended turn by turn (it re-renders earlier turns differently)."""


class MultiTurnEnv(Environment):
    """Alternates model turns and ``env_response`` until ``is_completed``, ``max_turns`` model turns, a truncated
    model turn, or no room left within ``max_seq_len`` (the last two mark the rollout truncated).

    Subclasses implement ``env_response`` and usually ``is_completed`` (plain or ``async def``).
    """

    def __init__(self, *args: Any, max_turns: int = 10, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if max_turns < 1:
            raise ValueError(f"{self.name}: max_turns must be >= 1, got {max_turns}.")
        self.max_turns = max_turns

    def is_completed(self, messages: Messages, state: dict[str, Any]) -> bool:
        """Whether the conversation is over after the model's last turn (default: only ``max_turns`` ends it)."""
        return False

    def env_response(self, messages: Messages, state: dict[str, Any]) -> Messages:
        """The environment's messages in reply to the model's last turn (``messages[-1]``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement env_response(messages, state).")

    async def generate(
        self, sampler: Sampler, prompt: Messages, prompt_ids: list[int], state: dict[str, Any]
    ) -> Trajectory:
        messages = list(prompt)
        out = Trajectory(completion=[], completion_ids=[], completion_mask=[], completion_logprobs=[], truncated=False)
        while True:
            budget = min(self.max_new_tokens, self.max_seq_len - len(prompt_ids) - len(out.completion_ids))
            sample = await sampler.sample(prompt_ids + out.completion_ids, budget)
            sample.validate(budget)
            out.completion_ids += sample.token_ids
            out.completion_mask += [1] * len(sample.token_ids)
            out.completion_logprobs += sample.logprobs
            reply = {"role": "assistant", "content": self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)}
            messages.append(reply)
            out.completion.append(reply)
            state["turn"] += 1
            if sample.finish_reason == "length":
                out.truncated = True
                break
            if state["turn"] >= self.max_turns or await maybe_await(self.is_completed(messages, state)):
                break
            new = check_messages(await maybe_await(self.env_response(messages, state)), f"{self.name}.env_response")
            env_ids = self.environment_ids(messages, new, sample.token_ids[-1:])
            if len(prompt_ids) + len(out.completion_ids) + len(env_ids) >= self.max_seq_len:
                out.truncated = True  # no room for another model turn
                break
            messages += new
            out.completion += new
            out.completion_ids += env_ids
            out.completion_mask += [0] * len(env_ids)
            out.completion_logprobs += [0.0] * len(env_ids)
        return out

    def environment_ids(self, messages: Messages, new: Messages, last_sampled: list[int]) -> list[int]:
        """Token ids between the model's last turn (``messages[-1]``, whose last sampled token was ``last_sampled``)
        and its next turn: the rest of the end-of-turn, the ``new`` messages and the next generation prompt."""
        end_of_turn = self._end_of_turn_ids(messages)
        if end_of_turn[:1] == last_sampled:
            end_of_turn = end_of_turn[1:]  # the model emitted the template's end-of-turn token (its eos) itself
        so_far_text = self.render(messages, add_generation_prompt=False)
        extended_text = self.render(messages + new, add_generation_prompt=True)
        so_far, extended = self.encode(so_far_text), self.encode(extended_text)
        if extended[: len(so_far)] != so_far:
            at = next((i for i, (a, b) in enumerate(zip(so_far_text, extended_text)) if a != b), len(so_far_text))
            raise TemplateError(
                f"{self.name}: the chat template is not prefix-consistent: rendering the conversation with the new "
                f"environment messages changes the earlier turns (first difference at character {at}: "
                f"{so_far_text[at : at + 40]!r} became {extended_text[at : at + 40]!r}), so the tokens the model already "
                "produced cannot be kept verbatim. Use a template that renders earlier turns identically."
            )
        return end_of_turn + extended[len(so_far) :]

    def _end_of_turn_ids(self, messages: Messages) -> list[int]:
        probe = self.render(messages[:-1] + [{**messages[-1], "content": _CONTENT_PROBE}], add_generation_prompt=False)
        if _CONTENT_PROBE not in probe:
            raise TemplateError(
                f"{self.name}: the chat template does not render an assistant message's content verbatim."
            )
        return self.encode(probe.rsplit(_CONTENT_PROBE, 1)[1])
