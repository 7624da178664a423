"""What every command's parser (train, eval, vllm-serve) checks in its command line beyond argparse."""

from __future__ import annotations

import argparse


def repeated_flag(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """Why ``argv`` is refused if it gives one of ``parser``'s flags twice (``--x v`` or ``--x=v``, its spellings and
    its ``--no_x`` counting as it; a list flag's values are one use), else None: argparse kept the last value and
    said nothing, so ``--learning_rate 1e-5 ... --learning_rate 1e-3`` trained at 1e-3."""
    seen: dict[str, str] = {}
    for token in argv:
        if not token.startswith("--"):
            continue
        flag = token.split("=", 1)[0]
        action = parser._option_string_actions.get(flag)  # argparse's own map of every spelling to its flag
        if action is None or action.dest == "help":
            continue
        first = seen.get(action.dest)
        if first is None:
            seen[action.dest] = flag
        else:
            again = "" if first == flag else f" (as {first}, then {flag})"
            return (f"{first} given twice{again}; argparse would keep the last value: give it once (a list flag "
                    "takes its values after one flag).")
    return None
