"""Chat messages as plain dicts (``{"role": ..., "content": ...}``), the form chat templates take."""

from __future__ import annotations

from typing import Any

Message = dict[str, Any]
Messages = list[Message]


def check_messages(messages: Any, where: str) -> Messages:
    """Return a copy of ``messages`` if it is a list of messages with string ``role`` and ``content``; raise otherwise."""
    if not isinstance(messages, list):
        raise TypeError(f"{where}: expected a list of chat messages, got {type(messages).__name__}.")
    for position, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise TypeError(
                f"{where}: message {position} must be a dict with string 'role' and 'content', got {message!r}."
            )
    return [dict(message) for message in messages]


def last_assistant_text(completion: Messages | str) -> str:
    """The content of the last assistant message of ``completion`` ('' if none); a string is returned as is."""
    if isinstance(completion, str):
        return completion
    for message in reversed(completion):
        if message.get("role") == "assistant":
            return message.get("content") or ""
    return ""
