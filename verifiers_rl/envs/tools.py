"""ToolEnv: plain Python functions offered to the model as tools through its chat template's tool calling."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from .awaitable import maybe_await
from .messages import Message, Messages
from .multiturn import MultiTurnEnv

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> list[dict[str, Any] | str]:
    """Each ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in ``text``, as a dict with ``name`` and
    ``arguments`` (a dict); a call that cannot be read is returned as a string describing the problem."""
    calls: list[dict[str, Any] | str] = []
    for body in _TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
            arguments = call.get("arguments", {}) if isinstance(call, dict) else None
            if isinstance(arguments, str):
                arguments = json.loads(arguments)  # some models write the arguments as a JSON string
        except json.JSONDecodeError as error:
            calls.append(f"the tool call is not valid JSON ({error.msg}): {body.strip()!r}")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            calls.append(f'a tool call must be {{"name": <string>, "arguments": <object>}}, got {body.strip()!r}')
            continue
        calls.append({"name": call["name"], "arguments": arguments})
    return calls


class ToolEnv(MultiTurnEnv):
    """The model may call ``tools`` (functions with type hints and a Google-style docstring, plain or ``async def``);
    each call's result, or its error as text, comes back as a ``{"role": "tool"}`` message. The rollout is complete
    when the model answers without a tool call. Takes the arguments of ``MultiTurnEnv`` plus ``tools``.
    """

    def __init__(self, *args: Any, tools: Sequence[Callable[..., Any]], **kwargs: Any):
        from transformers.utils import get_json_schema  # here, not at import: only tool environments need transformers

        self.tools = {tool.__name__: tool for tool in tools}
        try:
            self.tool_schemas = [get_json_schema(tool) for tool in tools]
        except Exception as error:  # transformers raises several exception types, all meaning "cannot describe it"
            raise ValueError(f"ToolEnv: cannot describe a tool to the model: {error}") from error
        super().__init__(*args, **kwargs)
        probe = self.render([{"role": "user", "content": "?"}], add_generation_prompt=True)
        missing = [name for name in self.tools if name not in probe]
        if missing:
            raise ValueError(
                f"{self.name}: the tokenizer's chat template does not show the tools {missing} to the model; "
                "use a chat template with tool support."
            )

    def render(self, messages: Messages, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tool_schemas, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def is_completed(self, messages: Messages, state: dict[str, Any]) -> bool:
        return not parse_tool_calls(messages[-1]["content"])

    async def env_response(self, messages: Messages, state: dict[str, Any]) -> Messages:
        return [await self.call_tool(call) for call in parse_tool_calls(messages[-1]["content"])]

    async def call_tool(self, call: dict[str, Any] | str) -> Message:
        """Run one parsed tool call; any problem becomes the tool message's text, for the model to read."""
        if isinstance(call, str):
            return {"role": "tool", "content": f"Error: {call}"}
        name = call["name"]
        if name not in self.tools:
            return {
                "role": "tool",
                "name": name,
                "content": f"Error: unknown tool {name!r}; available: {sorted(self.tools)}.",
            }
        try:
            result = await maybe_await(self.tools[name](**call["arguments"]))
        except Exception as error:  # noqa: BLE001 - the model sees its mistake instead of the rollout crashing
            return {"role": "tool", "name": name, "content": f"Error: {type(error).__name__}: {error}"}
        return {"role": "tool", "name": name, "content": str(result)}
