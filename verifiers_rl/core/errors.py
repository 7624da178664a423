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


class OutputDirInUseError(CheckpointError):
    """A fresh run's --output_dir holds an earlier run's checkpoints, which it would write over."""


class BestMetricError(ValueError):
    """--metric_for_best_model names no metric the evaluation logs (known at the first evaluation)."""


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


def _frames(error: BaseException) -> list[tuple[str, int]]:
    """(file, line) of each frame ``error`` passed through, outermost first; importlib's frozen frames left out."""
    frames, traceback = [], error.__traceback__
    while traceback is not None:
        name = traceback.tb_frame.f_code.co_filename
        if not name.startswith("<"):
            frames.append((str(Path(name).resolve()), traceback.tb_lineno))
        traceback = traceback.tb_next
    return frames


def users_line(error: BaseException) -> str | None:
    """``file:line`` of the innermost frame of ``error`` in the user's own files (not verifiers_rl's, the
    interpreter's or an installed package's), or None. A SyntaxError says its own file and line."""
    if isinstance(error, SyntaxError) and error.filename:
        return f"{error.filename}:{error.lineno}"
    own = [(name, line) for name, line in _frames(error) if not name.startswith((_OURS, *_LIBRARIES))]
    return f"{own[-1][0]}:{own[-1][1]}" if own else None


def raised_at(error: BaseException) -> str | None:
    """Where ``error`` was raised, as ``file:line``, unless verifiers_rl raised it (None: its messages say what to
    change, and its bugs keep their traceback): ``users_line``, else the innermost frame (a library's)."""
    frames = _frames(error)
    if not isinstance(error, SyntaxError) and (not frames or frames[-1][0].startswith(_OURS)):
        return None
    return users_line(error) or (f"{frames[-1][0]}:{frames[-1][1]}" if frames else None)


def root_cause(error: BaseException) -> BaseException:
    """The first error of the chain that ``raise ... from`` built on ``error``."""
    seen = {id(error)}
    while error.__cause__ is not None and id(error.__cause__) not in seen:
        error = error.__cause__
        seen.add(id(error))
    return error


def is_our_bug(error: BaseException) -> bool:
    """Whether ``error`` looks like a bug of verifiers_rl's, whose traceback is worth printing: not raised in the
    user's code, not one of verifiers_rl's own error classes, and not a ValueError or TypeError that verifiers_rl
    raised to refuse something."""
    if users_line(error) is not None or type(error).__module__.startswith("verifiers_rl"):
        return False
    return not (isinstance(error, (ValueError, TypeError)) and raised_at(error) is None)
