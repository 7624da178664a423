"""Parsers turn a completion's text into the answer a reward function compares."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from verifiers_rl.envs.messages import Messages, last_assistant_text


def extract_boxed_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text`` (nested and escaped braces handled); None if there is
    none or it is not closed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    position = start + len("\\boxed{")
    depth = 1
    while position < len(text):
        char = text[position]
        if char == "\\":
            position += 2  # an escaped character (\{ or \}) is content, not structure
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start + len("\\boxed{") : position]
        position += 1
    return None


class Parser:
    """Plain text: the answer is the stripped text, or ``extract(text)`` when given (e.g. extract_boxed_answer)."""

    def __init__(self, extract: Callable[[str], str | None] | None = None):
        self.extract = extract

    def parse(self, text: str) -> str | None:
        """The answer in ``text``, None if it holds none."""
        return self.extract(text) if self.extract else text.strip()

    def parse_answer(self, completion: Messages | str) -> str | None:
        """The answer in the last assistant message of ``completion`` (or in ``completion`` itself, a string)."""
        return self.parse(last_assistant_text(completion))


class ThinkParser(Parser):
    """For reasoning models: the answer is taken from the text after the last ``</think>``; None without one."""

    def parse(self, text: str) -> str | None:
        if "</think>" not in text:
            return None
        return super().parse(text.rsplit("</think>", 1)[1])


class XMLParser(Parser):
    """Fields written as ``<field>...</field>``; a field's value is the content of its last occurrence.

    ``parse`` returns the ``answer_field``; ``format_reward`` is a reward function for the format itself.
    """

    def __init__(self, fields: Sequence[str] = ("think", "answer"), answer_field: str = "answer"):
        super().__init__()
        if not fields or answer_field not in fields:
            raise ValueError(f"XMLParser: answer_field {answer_field!r} must be one of fields {list(fields)}.")
        self.fields = list(fields)
        self.answer_field = answer_field
        self._patterns = {name: re.compile(rf"<{name}>(.*?)</{name}>", re.DOTALL) for name in self.fields}

    def parse_fields(self, text: str) -> dict[str, str | None]:
        """Each field's stripped content (its last occurrence), None where the field is missing."""
        values: dict[str, str | None] = {}
        for name, pattern in self._patterns.items():
            matches = pattern.findall(text)
            values[name] = matches[-1].strip() if matches else None
        return values

    def parse(self, text: str) -> str | None:
        return self.parse_fields(text)[self.answer_field]

    def format_reward(self, completion: Messages | str) -> float:
        """Fraction of the fields present in each assistant message, averaged over the assistant messages."""
        if isinstance(completion, str):
            texts = [completion]
        else:
            texts = [m.get("content") or "" for m in completion if m.get("role") == "assistant"]
        if not texts:
            return 0.0
        scores = [sum(v is not None for v in self.parse_fields(t).values()) / len(self.fields) for t in texts]
        return sum(scores) / len(scores)
