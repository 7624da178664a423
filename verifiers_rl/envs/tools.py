"""ToolEnv: plain Python functions offered to the model as tools, through its chat template's tool calling or,
for a template without tool support, described in the system prompt (``tool_mode``)."""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import re
from collections.abc import Callable, Collection, Sequence
from typing import Any

from verifiers_rl.envs.awaitable import call_off_loop
from verifiers_rl.core.choices import check_chat_template_kwargs
from verifiers_rl.envs.messages import Message, Messages
from verifiers_rl.envs.multiturn import MultiTurnEnv

logger = logging.getLogger(__name__)

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_TOOL_CALL_MARKERS = ("<tool_call>", "</tool_call>")
_NINE_LETTERS_AND_DIGITS = re.compile(r"[A-Za-z0-9]{9}")
_GENERATED_ID = re.compile(r"call[0-9]{5}|T[0-9a-z]{8}")  # tool_call_id's own forms
TOOL_MODES = ("auto", "template", "text")
_DEFAULT_TOOL_MODE: contextvars.ContextVar[str] = contextvars.ContextVar("verifiers_rl_tool_mode", default="auto")
# The readers of the innermost default_tool_mode block (None outside one): "was --tool_mode used at all?"
_TOOL_MODE_READERS: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("verifiers_rl_tool_mode_readers",
                                                                                      default=None)


@contextlib.contextmanager
def default_tool_mode(mode: str):
    """Tool environments built inside this block default to ``mode`` (how ``--tool_mode`` reaches any loader).
    Yields the names of what read the mode inside (``current_tool_mode``; a nested block's readers included): empty
    when nothing built there renders tools."""
    if mode not in TOOL_MODES:
        raise ValueError(f"Unknown tool mode {mode!r}; expected one of {', '.join(TOOL_MODES)} (--tool_mode).")
    readers: list[str] = []
    token, readers_token = _DEFAULT_TOOL_MODE.set(mode), _TOOL_MODE_READERS.set(readers)
    try:
        yield readers
    finally:
        _DEFAULT_TOOL_MODE.reset(token)
        _TOOL_MODE_READERS.reset(readers_token)
        outer = _TOOL_MODE_READERS.get()
        if outer is not None:
            outer.extend(readers)


def current_tool_mode(reader: str = "") -> str:
    """The tool mode tool environments built now default to (``default_tool_mode``; ``auto`` outside one); the
    block records ``reader`` as having read it."""
    readers = _TOOL_MODE_READERS.get()
    if readers is not None:
        readers.append(reader)
    return _DEFAULT_TOOL_MODE.get()


def describe_tools(schemas: Sequence[dict[str, Any]]) -> str:
    """The system-prompt text of ``tool_mode="text"``: the tools' JSON schemas and the call format that
    ``parse_tool_calls`` reads."""
    listed = "\n".join(json.dumps(schema) for schema in schemas)
    return (
        "# Tools\nYou may call the functions below. Their JSON schemas:\n<tools>\n" + listed + "\n</tools>\n"
        'To call one, write <tool_call>{"name": <function name>, "arguments": <JSON object>}</tool_call>; '
        "its result comes back in the next message."
    )


class ToolRenderer:
    """Renders chats that offer ``schemas`` (OpenAI-style tool schemas) to the model, in one of two modes:

    - ``template``: the tokenizer's chat template shows the tools (``apply_chat_template(tools=...)``);
    - ``text``: for templates without tool support, the tools are described in the system message
      (``describe_tools``) and the chat is rendered without them.

    ``auto`` (the default, or the ``default_tool_mode`` in force) picks ``template`` when the template shows every
    tool's name and asks for ``<tool_call>`` blocks, else ``text`` with a one-line notice. Either way the model writes
    calls as ``<tool_call>`` blocks.
    """

    def __init__(self, tokenizer: Any, schemas: Sequence[dict[str, Any]], mode: str | None = None, name: str = "ToolEnv",
                 chat_template_kwargs: dict[str, Any] | None = None, mode_given: bool | None = None):
        # Whether the environment was given its mode (which --tool_mode does not override): errors name what fixes it.
        self.mode_given = mode is not None if mode_given is None else mode_given
        mode = current_tool_mode(name) if mode is None else mode
        if mode not in TOOL_MODES:
            # --tool_mode was checked by default_tool_mode: this one was given to the environment itself.
            raise ValueError(f"{name}: unknown tool_mode {mode!r} given to the environment (its tool_mode argument, "
                             f"e.g. from --env_args or the loader's code); expected one of {', '.join(TOOL_MODES)}.")
        self.tokenizer = tokenizer
        self.schemas = list(schemas)
        self.requested_mode = mode
        self.name = name
        # Every rendering passes them (the environment's chat_template_kwargs, e.g. enable_thinking).
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.mode = "template"
        problem = self._template_problem() if mode != "text" else None
        if mode == "text" or (mode == "auto" and problem):
            self.mode = "text"
            if mode == "auto":
                logger.warning(
                    "%s: the chat template %s, so the tools are described in the system prompt and "
                    "calls are read from <tool_call> blocks in the text (tool_mode='text').",
                    name,
                    "has no tool support" if problem.startswith("does not show") else problem,
                )
        elif mode == "template" and problem:
            where = ("the environment's tool_mode argument, e.g. in --env_args; --tool_mode does not override it"
                     if self.mode_given else "--tool_mode text")
            raise ValueError(
                f"{name}: the tokenizer's chat template {problem}; use a chat template with tool support that asks "
                f"for <tool_call> blocks, or tool_mode='text' ({where}) to describe the tools in the system prompt."
            )
        # Gemma's refuses a "tool" message (roles must alternate), others drop it: results then go in a user turn.
        self.tool_role = self.mode == "template" or self._shows_tool_messages()
        if not self.tool_role:
            logger.warning("%s: the chat template does not show tool messages, so tool results are sent as user "
                           "messages of <tool_response> blocks.", name)

    def with_kwargs(self, chat_template_kwargs: dict[str, Any]) -> "ToolRenderer":
        """A renderer of the same tools and requested mode with ``chat_template_kwargs`` (``auto`` decides anew)."""
        return ToolRenderer(self.tokenizer, self.schemas, self.requested_mode, self.name, chat_template_kwargs,
                            self.mode_given)

    def _template_problem(self) -> str | None:
        """Why the chat template cannot offer the tools (None if it can): it must show every tool's name and ask for
        calls as ``<tool_call>`` blocks, the only calls read (``parse_tool_calls``)."""
        if not self.schemas:
            return None
        probe = self._template([{"role": "user", "content": "?"}], True)
        hidden = [schema["function"]["name"] for schema in self.schemas if schema["function"]["name"] not in probe]
        if hidden:
            return f"does not show the tools {hidden} to the model"
        if "<tool_call>" not in probe:  # e.g. Llama 3.1's bare JSON: calls written as it asks would never run
            return "asks for tool calls in a format of its own, not the <tool_call> blocks that are read"
        return None

    def _shows_tool_messages(self) -> bool:
        """Whether the chat template renders a tool message after an assistant turn, showing its content."""
        probe = "\x00verifiers_rl-tool-result\x00"
        chat = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"},
                {"role": "tool", "content": probe}]
        try:
            return probe in self._template(chat, True)
        except Exception:  # noqa: BLE001 - the template's own refusal (jinja's raise_exception)
            return False

    def render(self, messages: Messages, add_generation_prompt: bool) -> str:
        if self.mode == "template":
            return self._template(messages, add_generation_prompt)
        if not self.tool_role:
            messages = tool_results_as_user_turns(messages)
        if self.schemas:
            messages = self._with_description(messages)
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.chat_template_kwargs)

    def _template(self, messages: Messages, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.schemas or None, tokenize=False, add_generation_prompt=add_generation_prompt,
            **self.chat_template_kwargs,
        )

    def _with_description(self, messages: Messages) -> Messages:
        description = describe_tools(self.schemas)
        if messages and messages[0]["role"] == "system":
            return [{**messages[0], "content": f"{messages[0]['content']}\n\n{description}"}, *messages[1:]]
        return [{"role": "system", "content": description}, *messages]


def tool_results_as_user_turns(messages: Messages) -> Messages:
    """``messages`` with each run of tool messages made one user message of ``<tool_response>`` blocks (Hermes' and
    Qwen's form), for a chat template that has no tool role."""
    out: Messages = []
    for position, message in enumerate(messages):
        if message["role"] != "tool":
            out.append(message)
            continue
        block = f"<tool_response>\n{message['content']}\n</tool_response>"
        if position and messages[position - 1]["role"] == "tool":  # the same run: one user turn
            out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n{block}"}
        else:
            out.append({"role": "user", "content": block})
    return out


def tool_call_id(call: dict[str, Any] | str, turn: int, index: int, taken: Collection[str] = ()) -> str:
    """The id of ``call``, the ``index``-th tool call of model turn ``turn`` (as ``parse_tool_calls`` gives it): the
    model's own ``id`` where it is 9 letters and digits, is not of the generated form below and is not in ``taken``
    (ids the episode gave already), else one of that form, the one Mistral's template insists on (a sampled id of
    another form would fail the rollout there), unique within a rollout and a function of it alone: ``call01000``
    (turn 1, call 0) for turns below 100 and calls below 1000, else ``T`` and the turn and the index in 4 base-36
    digits each (``T002s0000``: turn 100, call 0). ``tool_call_ids`` gives a whole turn's."""
    own = call.get("id", "") if isinstance(call, dict) else ""
    # A model id of the generated form could equal one generated before or after it: two results of one id.
    if _NINE_LETTERS_AND_DIGITS.fullmatch(own) and not _GENERATED_ID.fullmatch(own) and own not in taken:
        return own
    if turn < 100 and index < 1000:
        return f"call{turn:02d}{index:03d}"
    if max(turn, index) >= _BASE36_LIMIT:  # 1.7 million turns or calls of one turn: no 9-character id is left
        raise ValueError(f"tool call {index} of model turn {turn}: no 9-character tool_call_id is left past "
                         f"{_BASE36_LIMIT - 1} turns or calls of a turn; lower max_turns or max_new_tokens.")
    return f"T{_base36(turn)}{_base36(index)}"


def tool_call_ids(calls: Sequence[dict[str, Any] | str], turn: int, taken: Collection[str] = ()) -> list[str]:
    """The ids of model turn ``turn``'s ``calls`` (``tool_call_id``), unique within the episode: a model id used by
    an earlier call of the turn or in ``taken`` (the ids of the episode's earlier turns) is replaced."""
    given = set(taken)
    ids = []
    for index, call in enumerate(calls):
        ids.append(tool_call_id(call, turn, index, given))
        given.add(ids[-1])
    return ids


_BASE36_LIMIT = 36**4


def _base36(number: int) -> str:
    """``number`` (< 36**4) as 4 base-36 digits (0-9, a-z)."""
    digits = ""
    for _ in range(4):
        number, digit = divmod(number, 36)
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"[digit] + digits
    return digits


def tool_result_text(result: Any) -> str:
    """A tool's return value as the tool message's text: a string as it is; a dict, list, number, bool or None as
    JSON (``{"ok": true}``, not Python's ``{'ok': True}``), a value inside it that JSON cannot hold written as its
    ``str()``; any other object as its ``str()``."""
    if isinstance(result, str):
        return result
    if isinstance(result, (dict, list, tuple, int, float, type(None))):
        try:
            return json.dumps(result, ensure_ascii=False, default=str)
        except (TypeError, ValueError):  # keys JSON cannot hold (a tuple) or a circular reference
            pass
    return str(result)


def parse_tool_calls(text: str) -> list[dict[str, Any] | str]:
    """Each ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in ``text``, as a dict with ``name`` and
    ``arguments`` (a dict), and ``id`` where the model wrote a string one; a call that cannot be read is returned as a
    string describing the problem."""
    calls: list[dict[str, Any] | str] = []
    for body in _TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as error:
            calls.append(f"the tool call is not valid JSON ({error.msg}): {body.strip()!r}")
            continue
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as error:  # the call itself was JSON: say which part is not
                calls.append(f"the tool call's arguments are a string that is not valid JSON ({error.msg}): "
                             f"{body.strip()!r}")
                continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            calls.append(f'a tool call must be {{"name": <string>, "arguments": <object>}}, got {body.strip()!r}')
            continue
        calls.append({"name": call["name"], "arguments": arguments,
                      **({"id": call["id"]} if isinstance(call.get("id"), str) and call["id"] else {})})
    return calls


def decode_keeping_tool_calls(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """``token_ids`` as text without special tokens (the eos that ends a turn) but for ``<tool_call>`` and
    ``</tool_call>``, which some tokenizers count as special tokens: decoded with ``skip_special_tokens=True`` they
    vanished, and no call of the model's was ever read (``parse_tool_calls``)."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    special = set(tokenizer.all_special_ids) | {i for i, token in added.items() if token.special}
    skipped = special - {i for i, token in added.items() if token.content in _TOOL_CALL_MARKERS}
    return tokenizer.decode([i for i in token_ids if i not in skipped], skip_special_tokens=False)


def check_tools(tools: Any) -> None:
    """Refuse ``tools`` that are not a list of named functions (``tools=add`` for ``tools=[add]``, a tool's name)."""
    if callable(tools) or isinstance(tools, (str, bytes, dict)) or not isinstance(tools, Sequence):
        raise TypeError(f"ToolEnv: tools must be a list of functions, got {type(tools).__name__} {tools!r:.60} "
                        "(for one tool: tools=[f]).")
    for tool in tools:
        if not callable(tool) or not isinstance(getattr(tool, "__name__", None), str):
            raise TypeError(f"ToolEnv: each tool must be a function (its __name__ is the name calls use), got "
                            f"{type(tool).__name__} {tool!r:.60}.")


class ToolEnv(MultiTurnEnv):
    """The model may call ``tools`` (functions with type hints and a Google-style docstring, plain or ``async def``; a
    plain one runs in a worker thread, several rollouts' at once); each call's result, or its error as text, comes back
    as a ``{"role": "tool"}`` message. The rollout is complete when the model answers without a tool call; one whose
    last turn ``max_turns`` allows calls tools ends there, its calls not run, marked truncated
    (``max_turns_truncates``). Takes the arguments of ``MultiTurnEnv`` plus ``tools`` and ``tool_mode`` (``auto``,
    ``template`` or ``text``: see ``ToolRenderer``).
    """

    renders_chat_template_kwargs = True  # its ToolRenderer passes them on
    # A last allowed turn that calls tools is cut short: its calls never run, so the rollout is marked truncated.
    max_turns_truncates = True

    def __init__(
        self,
        dataset: Any,
        rubric: Any,
        tokenizer: Any,
        *,
        tools: Sequence[Callable[..., Any]],
        tool_mode: str | None = None,
        **kwargs: Any,
    ):
        from transformers.utils import get_json_schema  # here, not at import: only tool environments need transformers

        check_tools(tools)
        self.tools = {tool.__name__: tool for tool in tools}
        if len(self.tools) < len(tools):  # calls find a tool by name: all but the last of a name would be unreachable
            twice = sorted({tool.__name__ for tool in tools if [t.__name__ for t in tools].count(tool.__name__) > 1})
            raise ValueError(f"ToolEnv: two tools are named {twice[0]!r}; a call names the tool it runs, so give each "
                             "tool a distinct name (its function's __name__).")
        try:
            self.tool_schemas = [get_json_schema(tool) for tool in tools]
        except Exception as error:  # transformers raises several exception types, all meaning "cannot describe it"
            raise ValueError(f"ToolEnv: cannot describe a tool to the model: {error}") from error
        # Before Environment.__init__, which renders every prompt to check its length.
        self.tool_renderer = ToolRenderer(tokenizer, self.tool_schemas, tool_mode, kwargs.get("name") or "ToolEnv",
                                          check_chat_template_kwargs(kwargs.get("chat_template_kwargs")))
        super().__init__(dataset, rubric, tokenizer, **kwargs)

    @property
    def tool_mode(self) -> str:
        """``template`` or ``text``: how the tools reach the model."""
        return self.tool_renderer.mode

    def render(self, messages: Messages, add_generation_prompt: bool) -> str:
        return self.tool_renderer.render(messages, add_generation_prompt)

    def _chat_template_kwargs_changed(self) -> None:
        self.tool_renderer = self.tool_renderer.with_kwargs(self.chat_template_kwargs)

    def decode_reply(self, token_ids: list[int]) -> str:
        return decode_keeping_tool_calls(self.tokenizer, token_ids)  # its calls are read from this text

    def is_completed(self, messages: Messages, state: dict[str, Any]) -> bool:
        return not parse_tool_calls(messages[-1]["content"])

    async def env_response(self, messages: Messages, state: dict[str, Any]) -> Messages:
        """One tool message per call of the model's last turn, in order, each with the ``tool_call_id`` of its call
        (``tool_call_ids``: unique within the episode), as chat templates and verifiers expect."""
        calls = parse_tool_calls(messages[-1]["content"])
        taken = [m["tool_call_id"] for m in messages if m["role"] == "tool" and "tool_call_id" in m]
        ids = tool_call_ids(calls, state["turn"], taken)
        return [{**await self.call_tool(call), "tool_call_id": id_} for call, id_ in zip(calls, ids)]

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
        try:  # the result's text too: an int past Python's 4300 digits, an object whose __str__ raises
            text = tool_result_text(await call_off_loop(self.tools[name], **call["arguments"]))
        except Exception as error:  # noqa: BLE001 - the model sees its mistake instead of the rollout crashing
            return {"role": "tool", "name": name, "content": f"Error: {type(error).__name__}: {error}"}
        return {"role": "tool", "name": name, "content": text}
