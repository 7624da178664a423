"""Errors raised below the training side too (compat's guarded loader), so they live where every part can import
them; the YAML file reader whose failures name the flag that gave the file; and where a user's code raised."""

import os
import sysconfig
from pathlib import Path

_OURS = str(Path(__file__).resolve().parents[1]) + os.sep  # the verifiers_rl package
_LIBRARIES = tuple({str(Path(sysconfig.get_paths()[key]).resolve()) + os.sep
                    for key in ("stdlib", "purelib", "platlib")})  # the interpreter's and installed packages


class CheckpointError(ValueError):
    """A checkpoint cannot be resumed from: missing, incomplete, crafted, or made by a run this one is not."""


def unknown_keys(given, known, what: str, hint: str) -> str | None:
    """The message refusing ``given``'s keys outside ``known`` (``what`` names the mapping, ``hint`` says where
    they belong), None when every key is known."""
    unknown = sorted(set(given) - set(known))
    if not unknown:
        return None
    return f"{what} has unknown key(s) {', '.join(map(repr, unknown))}; {hint}"


def read_yaml(path: str, flag: str):
    """The content of the YAML file ``flag`` names; one it cannot read or parse is a ValueError naming both."""
    import yaml

    try:
        with open(path) as handle:
            return yaml.safe_load(handle)
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot read the file ({error.strerror}).") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{flag} {path} is not valid YAML: {' '.join(str(error).split())}") from None


def raised_at(error: BaseException) -> str | None:
    """Where ``error`` was raised, as ``file:line``, unless verifiers_rl raised it (None: its messages say what to
    change, and its bugs keep their traceback): the innermost frame in the user's own files, else the innermost
    frame (a library's). A SyntaxError says its own file and line."""
    if isinstance(error, SyntaxError) and error.filename:
        return f"{error.filename}:{error.lineno}"
    frames = []
    traceback = error.__traceback__
    while traceback is not None:
        name = traceback.tb_frame.f_code.co_filename
        if not name.startswith("<"):  # importlib's frozen frames say nothing of use
            frames.append((str(Path(name).resolve()), traceback.tb_lineno))
        traceback = traceback.tb_next
    if not frames or frames[-1][0].startswith(_OURS):
        return None
    own = [(name, line) for name, line in frames if not name.startswith((_OURS, *_LIBRARIES))]
    name, line = (own or frames)[-1]
    return f"{name}:{line}"
