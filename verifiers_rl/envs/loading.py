"""``load_environment(spec)``: a built-in name, ``"pkg.module:function"``, or a ``.py`` file with ``load_environment``."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from .environment import Environment

BUILTINS = {
    "reverse_text": "verifiers_rl.envs.builtin.reverse_text:load_environment",
    "arithmetic": "verifiers_rl.envs.builtin.arithmetic:load_environment",
    "calculator": "verifiers_rl.envs.builtin.calculator:load_environment",
}
DEFAULT_ENVIRONMENT = "reverse_text"


def _from_module(spec: str) -> Any:
    module_name, _, function_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise ValueError(f"Environment {spec!r}: cannot import module {module_name!r} ({error}).") from error
    if not hasattr(module, function_name):
        raise ValueError(f"Environment {spec!r}: module {module_name!r} has no {function_name!r}.")
    return getattr(module, function_name)


def _from_file(path: Path) -> Any:
    module_spec = importlib.util.spec_from_file_location(f"verifiers_rl_env_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # as an import would: dataclasses and pickling look modules up there
    module_spec.loader.exec_module(module)
    if not hasattr(module, "load_environment"):
        raise ValueError(f"Environment file {str(path)!r} defines no load_environment(**kwargs).")
    return module.load_environment


def load_environment(spec: str, **kwargs: Any) -> Environment:
    """Build the environment ``spec`` names, passing ``kwargs`` (e.g. ``tokenizer``, ``num_examples``) to its loader.

    ``spec`` is a built-in name (see ``BUILTINS``), ``"pkg.module:function"``, or the path of a ``.py`` file that
    defines ``load_environment(**kwargs)``.
    """
    if spec.endswith(".py") or Path(spec).is_file():
        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(f"Environment file {spec!r} does not exist.")
        loader = _from_file(path)
    elif ":" in spec:
        loader = _from_module(spec)
    elif spec in BUILTINS:
        loader = _from_module(BUILTINS[spec])
    else:
        raise ValueError(
            f"Unknown environment {spec!r}. Built-ins: {', '.join(BUILTINS)}; or pass 'pkg.module:function' or the "
            "path of a .py file that defines load_environment(**kwargs)."
        )
    environment = loader(**kwargs)
    if not isinstance(environment, Environment):
        raise TypeError(
            f"Environment {spec!r}: the loader returned a {type(environment).__name__}, not an Environment."
        )
    return environment
