"""MultiTurnEnv: model turns and environment turns alternate; the trained tokens are exactly the sampled tokens.

The token sequence is built incrementally, never re-tokenised: prompt ids, then each sample's ids verbatim
(mask 1), then the environment's ids (mask 0, ``turns.bridge_ids``).
"""

from __future__ import annotations

from typing import Any

from verifiers_rl.envs.awaitable import maybe_await
from verifiers_rl.envs.environment import Environment, Trajectory, check_limit
from verifiers_rl.envs.messages import Messages, check_messages
from verifiers_rl.core.sampling import Sampler
from verifiers_rl.envs.turns import TemplateError, bridge_ids  # noqa: F401  (TemplateError: re-exported by envs)

class MultiTurnEnv(Environment):
    """Alternates model turns and ``env_response`` until ``is_completed``, ``max_turns`` model turns, a reply of the
    environment's that ends the episode (``state["final_env_response"]``), a truncated model turn, or no room left
    within ``max_seq_len`` (the last two mark the rollout truncated, and ``max_turns`` does where
    ``max_turns_truncates``).

    Subclasses implement ``env_response`` and usually ``is_completed`` (plain or ``async def``). A plain one runs on
    the event loop, one at a time (no lock needed for shared state), holding up every rollout in flight while it runs:
    a slow one is ``async def`` and awaits its slow part with ``call_off_loop`` (docs/environments.md).
    """

    # Whether an episode that max_turns ends unfinished (is_completed said no after the last allowed turn) is marked
    # truncated, as a turn cut by max_new_tokens is (--mask_truncated_completions then masks it). False, as in
    # verifiers' MultiTurnEnv, where max_turns is an ordinary end; ToolEnv: True (that turn's tool calls never run).
    max_turns_truncates: bool = False

    def __init__(self, *args: Any, max_turns: int = 10, **kwargs: Any):
        super().__init__(*args, **kwargs)
        check_limit(self.name, "max_turns", max_turns, 1)
        self.max_turns = max_turns
        # Said now, not at the first model turn that ends before max_new_tokens (perhaps steps into the run).
        if max_turns > 1 and type(self).env_response is MultiTurnEnv.env_response:
            raise ValueError(f"{self.name}: {type(self).__name__} defines no env_response(messages, state), which a "
                             f"MultiTurnEnv of max_turns={max_turns} calls after each model turn but its last: define "
                             "it (or use a SingleTurnEnv).")

    def is_completed(self, messages: Messages, state: dict[str, Any]) -> bool:
        """Whether the conversation is over after the model's last turn (default: only ``max_turns`` ends it). Called
        after every model turn that was not cut by a length limit, the last one ``max_turns`` allows included."""
        return False

    def env_response(self, messages: Messages, state: dict[str, Any]) -> Messages:
        """The environment's messages in reply to the model's last turn (``messages[-1]``). To end the episode with
        this reply (a game decided by the model's move), set ``state["final_env_response"]`` to the reply, as verifiers'
        MultiTurnEnv does: those messages end the completion (the rubric reads them) and no model turn follows."""
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
            reply = {"role": "assistant", "content": self.decode_reply(sample.token_ids)}
            messages.append(reply)
            out.completion.append(reply)
            state["turn"] += 1
            if sample.finish_reason == "length":
                out.truncated = True
                break
            # is_completed first: it sees every complete turn, the last allowed one too (it may record the outcome).
            if await maybe_await(self.is_completed(messages, state)):
                break
            if state["turn"] >= self.max_turns:
                out.truncated = self.max_turns_truncates
                break
            new = check_messages(await maybe_await(self.env_response(messages, state)), f"{self.name}.env_response")
            if state.get("final_env_response") is not None:  # the environment's reply ended the episode
                final = check_messages(state["final_env_response"], f"{self.name}: state['final_env_response']")
                messages += final
                out.completion += final  # for the rubric; no model turn follows, so no tokens
                break
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

    def decode_reply(self, token_ids: list[int]) -> str:
        """A model turn's sampled ids as its message's text, without special tokens (the eos that ends the turn)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def environment_ids(self, messages: Messages, new: Messages, last_sampled: list[int]) -> list[int]:
        """Token ids between the model's last turn (whose last sampled token was ``last_sampled``) and its next turn:
        the rest of the end-of-turn, the ``new`` messages and the next generation prompt (``turns.bridge_ids``)."""
        return bridge_ids(self.render, self.encode, last_sampled, new, self.name)
