"""A verifiers ``Client`` over verifiers_rl's inference engines, so a classic verifiers environment samples from
the policy being trained and every model turn carries the exact sampled token ids and log-probs.

The environment hands the client chat messages; the client renders them with the policy tokenizer's chat template
(tools shown by the template, or described in the system prompt: ``ToolRenderer``), samples with the engine
(in process for the embedded engine, through the vLLM server for ``--vllm_server_url``) and returns a
``vf.Response`` whose ``message.tokens`` hold the prompt ids, the sampled ids and their log-probs. A later turn's
prompt is never re-tokenised: it is the previous turn's prompt and sampled ids, then the template's tokens for the
environment's new messages (token in, token out, as verifiers' own vLLM token client does), so one rollout is one
token sequence whose model tokens are exactly the sampled ones.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any

import verifiers as vf
from verifiers.types import Response, ResponseMessage, ResponseTokens, ToolCall, Usage

from verifiers_rl.envs.turns import TemplateError, bridge_ids
from verifiers_rl.core.sampling import Sample, Sampler, rollout_sampling
from verifiers_rl.envs.tools import ToolRenderer, decode_keeping_tool_calls, parse_tool_calls, tool_call_ids

_TOOL_CALL_BLOCK = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


def plain_message(message: Any) -> dict[str, Any]:
    """A verifiers message (pydantic or dict) as the plain dict chat templates take: string content, tool calls in
    the Hugging Face form ``{"type": "function", "function": {"name", "arguments": {...}}}``."""
    data = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)
    data = {key: value for key, value in data.items() if value is not None}
    content = data.get("content") or ""
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"]
        if len(texts) != len(content):
            raise ValueError("multimodal message content (images, audio) is not supported; only text.")
        content = "".join(texts)
    data["content"] = content
    if data.get("tool_calls"):
        data["tool_calls"] = [_hf_tool_call(call) for call in data["tool_calls"]]
    return data


def plain_messages(messages: Any) -> list[dict[str, Any]]:
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    return [plain_message(message) for message in messages]


def _hf_tool_call(call: Any) -> dict[str, Any]:
    call = call.model_dump() if hasattr(call, "model_dump") else dict(call)
    if "function" in call:
        return call
    try:
        arguments = json.loads(call.get("arguments") or "{}")
    except json.JSONDecodeError:
        arguments = call.get("arguments")
    return {"id": call.get("id"), "type": "function", "function": {"name": call.get("name"), "arguments": arguments}}


def tool_schema(tool: Any) -> dict[str, Any]:
    """A ``vf.Tool`` as the OpenAI-style schema chat templates take."""
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    return {"type": "function", "function": function}


@dataclass
class EngineReply:
    """The client's native response: the rendered prompt ids and the engine's sample."""

    prompt_ids: list[int]
    sample: Sample
    model: str
    tools_offered: bool
    turn: int
    taken_ids: list[str]  # the tool call ids of the episode's earlier turns (ids are unique within an episode)


class EngineClient(vf.Client):
    """``vf.Client`` over a verifiers_rl ``Sampler`` (an inference engine).

    Each model turn samples at most ``min(max_tokens, max_seq_len - prompt length)`` tokens, ``max_tokens`` being
    the request's ``max_tokens`` / ``max_completion_tokens`` or ``max_new_tokens``; a prompt that leaves no room
    raises ``vf.OverlongPromptError`` (the environment then stops the rollout as truncated). Sampling itself
    (temperature, seed) is the engine's and the calling rollout's ``RolloutSampling``, which must be set: a model
    call made outside the rollout's context (from a thread pool that does not carry contextvars) is an error.
    """

    def __init__(self, sampler: Sampler | None, tokenizer: Any, *, max_seq_len: int, max_new_tokens: int,
                 tool_mode: str, name: str, renderers: dict[str, ToolRenderer] | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None, tool_mode_given: bool = False):
        super().__init__(sampler)
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.max_new_tokens = max_new_tokens
        self.tool_mode = tool_mode
        self.tool_mode_given = tool_mode_given  # False: tool_mode is --tool_mode's (ToolRenderer.mode_given)
        self.name = name
        self._renderers = {} if renderers is None else renderers  # shared by an environment's clients
        self.chat_template_kwargs = dict(chat_template_kwargs or {})  # the environment's: every rendering gets them

    def setup_client(self, config: Any) -> Any:
        raise TypeError("EngineClient wraps a verifiers_rl inference engine; it is not built from a ClientConfig.")

    def renderer(self, schemas: list[dict[str, Any]] | None) -> ToolRenderer:
        """The renderer for a set of tools (one per set: ``auto`` decides, and notices, once)."""
        key = json.dumps(schemas or [], sort_keys=True)
        if key not in self._renderers:
            self._renderers[key] = ToolRenderer(self.tokenizer, schemas or [], self.tool_mode, self.name,
                                                self.chat_template_kwargs, self.tool_mode_given)
        return self._renderers[key]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    async def to_native_tool(self, tool: Any) -> dict[str, Any]:
        return tool_schema(tool)

    async def to_native_prompt(self, messages: Any) -> tuple[list[dict[str, Any]], dict]:
        return plain_messages(messages), {}

    async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs) -> EngineReply:
        if rollout_sampling() is None:
            raise RuntimeError(
                f"{self.name}: a model call ran outside its rollout's context (the environment called the model from "
                "a thread pool that does not carry contextvars, e.g. loop.run_in_executor), so its seed and "
                "temperature are unknown. Call the model from the rollout's own task or asyncio.to_thread."
            )
        state = kwargs.get("state") or {}
        renderer = self.renderer(tools)
        prompt_ids = self.prompt_ids(prompt, renderer, state.get("trajectory") or [])
        max_tokens = sampling_args.get("max_tokens") or sampling_args.get("max_completion_tokens") or self.max_new_tokens
        budget = min(int(max_tokens), self.max_seq_len - len(prompt_ids))
        if budget < 1:
            raise vf.OverlongPromptError(
                f"the prompt is {len(prompt_ids)} tokens, leaving no room within max_seq_len={self.max_seq_len}"
            )
        sample = await self.client.sample(prompt_ids, budget)
        sample.validate(budget)
        taken = [call.get("id") for message in prompt for call in message.get("tool_calls") or []]
        return EngineReply(prompt_ids, sample, model, bool(tools), len(state.get("trajectory") or []), taken)

    def prompt_ids(self, messages: list[dict[str, Any]], renderer: ToolRenderer, trajectory: list) -> list[int]:
        """The first turn's rendered prompt, or the previous turn's ids extended by the environment's messages."""
        if not trajectory:
            return self.encode(renderer.render(messages, add_generation_prompt=True))
        previous = trajectory[-1]
        so_far = plain_messages(list(previous["prompt"]) + list(previous["completion"]))
        if messages[: len(so_far)] != so_far:
            raise TemplateError(
                f"{self.name}: model turn {len(trajectory) + 1}'s prompt does not extend the conversation of the "
                "turn before (the environment rewrote earlier messages); verifiers_rl trains one token sequence per "
                "rollout, so each turn must append to the last."
            )
        tokens = previous["tokens"]
        sampled = list(tokens["prompt_ids"]) + list(tokens["completion_ids"])
        return sampled + bridge_ids(renderer.render, self.encode, sampled[-1:], messages[len(so_far) :], self.name)

    async def raise_from_native_response(self, response: EngineReply) -> None:
        return None

    async def from_native_response(self, response: EngineReply) -> Response:
        sample = response.sample
        if response.tools_offered:  # calls are read from the text: their markers may be special tokens
            text = decode_keeping_tool_calls(self.tokenizer, sample.token_ids)
        else:
            text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        calls = [c for c in parse_tool_calls(text) if isinstance(c, dict)] if response.tools_offered else []
        tool_calls = [ToolCall(id=id_, name=c["name"], arguments=json.dumps(c["arguments"]))
                      for c, id_ in zip(calls, tool_call_ids(calls, response.turn, response.taken_ids))]
        content = _TOOL_CALL_BLOCK.sub("", text).strip() if tool_calls else text
        truncated = sample.finish_reason == "length"
        tokens = ResponseTokens(
            prompt_ids=response.prompt_ids,
            prompt_mask=[0] * len(response.prompt_ids),
            completion_ids=list(sample.token_ids),
            completion_mask=[1] * len(sample.token_ids),
            completion_logprobs=list(sample.logprobs),
        )
        message = ResponseMessage(
            content=content,
            tool_calls=tool_calls or None,
            finish_reason="length" if truncated else "tool_calls" if tool_calls else "stop",
            is_truncated=truncated,
            tokens=tokens,
        )
        usage = Usage(prompt_tokens=len(response.prompt_ids), reasoning_tokens=0,
                      completion_tokens=len(sample.token_ids),
                      total_tokens=len(response.prompt_ids) + len(sample.token_ids))
        return Response(id=f"verifiers_rl-{time.time_ns()}", created=int(time.time()), model=response.model,
                        usage=usage, message=message)

    async def close(self) -> None:
        return None
