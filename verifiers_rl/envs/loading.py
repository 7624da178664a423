"""``load_environment(spec)``: what ``--env`` accepts.

- a built-in name (``BUILTINS``);
- ``reasoning_gym:<task>[,<task>...]`` (optional weights ``<task>=<w>``): reasoning-gym tasks;
- ``vf:<env_id>``: a verifiers environment, loaded with verifiers' own ``vf.load_environment(env_id, **env_args)``;
- ``pkg.module:function`` or the path of a ``.py`` file defining ``load_environment(**kwargs)``;
- a verifiers 0.4 (``verifiers.v1``) environment, unchanged: its ``.py`` file, package folder or importable module
  id (importable here or in the v1 venv), told apart by what it exports: ``__all__`` (a ``vf.Taskset``) from a
  module that imports ``verifiers.v1`` and defines no ``load_environment``. Run by ``V1Env``; ``env_args`` are
  its keyword arguments (``harness``, ``max_seq_len``, ``max_new_tokens``, v1 config sections).

A loader may return a verifiers_rl ``Environment`` or a classic verifiers ``vf.Environment``, which is wrapped in
``VerifiersEnv``.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import re
import logging
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from verifiers_rl.core.errors import raised_at
from verifiers_rl.envs.environment import Environment
from verifiers_rl.envs.tools import default_tool_mode

logger = logging.getLogger(__name__)

BUILTINS = {
    "reverse_text": "verifiers_rl.envs.builtin.reverse_text:load_environment",
    "arithmetic": "verifiers_rl.envs.builtin.arithmetic:load_environment",
    "calculator": "verifiers_rl.envs.builtin.calculator:load_environment",
}
DEFAULT_ENVIRONMENT = "reverse_text"
REASONING_GYM_PREFIX = "reasoning_gym:"
VERIFIERS_PREFIX = "vf:"


def _from_module(spec: str) -> Any:
    module_name, _, function_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name.split(".")[0] or os.getcwd() in sys.path:
            raise ValueError(f"Environment {spec!r}: cannot import module {module_name!r} ({error}).") from error
        # As `python -m` would find it: a console script (verifiers-rl) leaves the working directory off the path.
        sys.path.append(os.getcwd())
        return _from_module(spec)
    if not hasattr(module, function_name):
        raise ValueError(f"Environment {spec!r}: module {module_name!r} has no {function_name!r}.")
    return getattr(module, function_name)


def _from_file(path: Path) -> Any:
    module_spec = importlib.util.spec_from_file_location(f"verifiers_rl_env_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    folder = str(path.resolve().parent)
    if folder not in sys.path:  # as running the file would: it may import the modules beside it
        sys.path.insert(0, folder)
    sys.modules[module_spec.name] = module  # as an import would: dataclasses and pickling look modules up there
    module_spec.loader.exec_module(module)
    if not hasattr(module, "load_environment"):
        raise ValueError(f"Environment file {str(path)!r} defines no load_environment(**kwargs).")
    return module.load_environment


def _takes_tokenizer(loader: Any) -> bool:
    try:
        parameters = inspect.signature(loader).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == "tokenizer" or p.kind is p.VAR_KEYWORD for p in parameters)


def _is_verifiers_environment(value: Any) -> bool:
    """A classic verifiers environment (its class is only loaded if verifiers is)."""
    module = sys.modules.get("verifiers.legacy.envs.environment")
    return module is not None and isinstance(value, module.Environment)


def _is_verifiers_v1(value: Any) -> bool:
    return type(value).__module__.startswith("verifiers.v1")


def _imports_verifiers_v1(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(alias.name == "verifiers.v1" or alias.name.startswith("verifiers.v1.") for alias in node.names)
    if isinstance(node, ast.ImportFrom) and node.module:
        return (node.module == "verifiers.v1" or node.module.startswith("verifiers.v1.")
                or (node.module == "verifiers" and any(alias.name == "v1" for alias in node.names)))
    return False


def exports_v1_taskset(source: str) -> bool:
    """Whether module text is a verifiers 0.4 environment: it imports ``verifiers.v1``, sets ``__all__`` (v1 loads
    the Taskset it exports) and defines no ``load_environment`` (a classic or verifiers_rl loader)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    top = tree.body
    defines_loader = any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "load_environment"
                         for n in top)
    has_all = any(isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and any(
        isinstance(t, ast.Name) and t.id == "__all__" for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))
        for n in top)
    return has_all and not defines_loader and any(_imports_verifiers_v1(n) for n in ast.walk(tree))


def _module_file(spec: str) -> Path | None:
    """The source file of ``spec`` (a ``.py`` file, a package folder, or a module id importable here or in the
    verifiers 0.4 venv), or None."""
    path = Path(spec)
    if path.is_file():
        return path
    if path.is_dir():
        return path / "__init__.py" if (path / "__init__.py").is_file() else None
    if ":" in spec or spec in BUILTINS or not all(part.isidentifier() for part in spec.split(".")):
        return None
    try:
        found = importlib.util.find_spec(spec)
    except (ImportError, ValueError):
        found = None
    if found is not None:
        return Path(found.origin) if found.origin and found.origin.endswith(".py") else None
    from verifiers_rl.envs.adapters.verifiers_v1 import v1_python

    python = v1_python()
    if not python.exists():
        return None
    origin = subprocess.run(
        [str(python), "-c", "import importlib.util, sys; s = importlib.util.find_spec(sys.argv[1]); "
                            "print(s.origin if s and s.origin else '')", spec],
        capture_output=True, text=True, timeout=120).stdout.strip()
    return Path(origin) if origin.endswith(".py") else None


def is_v1_environment(spec: str) -> bool:
    """Whether ``--env spec`` names a verifiers 0.4 environment module (``exports_v1_taskset``)."""
    source = _module_file(spec)
    return source is not None and source.suffix == ".py" and exports_v1_taskset(source.read_text())


def load_environment(spec: str, tokenizer: Any = None, *, tool_mode: str = "auto", **kwargs: Any) -> Environment:
    """Build the environment ``spec`` names (module docstring), passing ``kwargs`` (e.g. ``num_examples``) to its
    loader, and ``tokenizer`` too where the loader takes one (a verifiers loader does not: the wrapper gets it).

    ``tool_mode`` (``auto``, ``template`` or ``text``) is the default of the tool environments built here. A
    keyword the loader does not take is a ValueError naming it (``--env_args``).
    """
    return load_with_args(spec, tokenizer, tool_mode, kwargs)


def load_with_args(spec: str, tokenizer: Any = None, tool_mode: str = "auto",
                   env_args: Mapping[str, Any] | None = None) -> Environment:
    """``load_environment`` with the loader's keyword arguments as one mapping (--env_args, an entry's env_args),
    so that none of them is taken for this function's own ``spec``, ``tokenizer`` or ``tool_mode``."""
    kwargs = dict(env_args or {})
    if "tokenizer" in kwargs:
        raise ValueError(f"Environment {spec!r}: 'tokenizer' cannot be one of its arguments (--env_args): the "
                         "policy's tokenizer is passed to every loader that takes one. Leave it out.")
    try:
        environment = _load(spec, tokenizer, tool_mode, kwargs)
    except TypeError as error:
        unexpected = re.search(r"unexpected keyword argument '([^']+)'", str(error))
        if unexpected is None or unexpected.group(1) not in kwargs:
            raise
        raise ValueError(f"Environment {spec!r} takes no argument {unexpected.group(1)!r} (from --env_args, "
                         f"--eval_env_args or load_environment's keywords): {error}") from error
    if isinstance(environment, Environment):
        return environment
    if _is_verifiers_v1(environment):
        raise TypeError(
            f"Environment {spec!r}: the loader returned a verifiers.v1 {type(environment).__name__}; verifiers_rl "
            "trains classic verifiers environments (verifiers 0.2-0.3: vf.SingleTurnEnv, vf.MultiTurnEnv, "
            "vf.ToolEnv, ...). verifiers.v1 runs its agents as separate programs that reach the model over HTTP."
        )
    raise TypeError(
        f"Environment {spec!r}: the loader returned a {type(environment).__name__}, which is neither a verifiers_rl "
        "Environment (verifiers_rl.envs: SingleTurnEnv, MultiTurnEnv, ToolEnv) nor a classic verifiers environment "
        "(vf.SingleTurnEnv, vf.MultiTurnEnv, vf.ToolEnv, ...)."
    )


def _parameters(function: Any) -> set[str]:
    """The named parameters of ``function`` (none when its signature cannot be read)."""
    try:
        return {p.name for p in inspect.signature(function).parameters.values()
                if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    except (TypeError, ValueError):
        return set()


def _say_unread_verifiers_args(spec: str, vf_env: Any, loader: Any, kwargs: dict[str, Any]) -> None:
    """Warn of the ``kwargs`` a classic verifiers environment only kept as attributes: its ``Environment`` takes
    unknown keywords and sets them on itself (a misspelt argument acts on nothing), named by neither the loader nor
    any constructor of the environment's class."""
    named = _parameters(loader)
    for cls in type(vf_env).__mro__:
        named |= _parameters(vars(cls)["__init__"]) if "__init__" in vars(cls) else set()
    kept = sorted(key for key, value in kwargs.items()
                  if key not in named and key in vars(vf_env) and vars(vf_env)[key] is value)
    if kept:
        logger.warning("Environment %r: its arguments %s (--env_args) are parameters of neither its loader nor its "
                       "environment's class: verifiers only keeps them as attributes of the environment, which nothing "
                       "of verifiers reads. A misspelt argument?", spec, kept)


def _load(spec: str, tokenizer: Any, tool_mode: str, kwargs: dict[str, Any]) -> Any:
    """What ``spec``'s loader returns (a classic verifiers environment wrapped in ``VerifiersEnv``)."""
    loader = None
    with default_tool_mode(tool_mode):
        if spec.startswith(VERIFIERS_PREFIX):
            from verifiers_rl.envs.adapters.verifiers_env import import_verifiers

            vf = import_verifiers()
            environment = vf.load_environment(spec[len(VERIFIERS_PREFIX) :], **kwargs)
            with contextlib.suppress(Exception):  # the module verifiers loaded it from: its loader's parameters
                from verifiers.legacy.utils.env_utils import import_env_module

                loader = getattr(import_env_module(spec[len(VERIFIERS_PREFIX) :]), "load_environment", None)
        elif spec.startswith(REASONING_GYM_PREFIX):
            from verifiers_rl.envs.adapters.reasoning_gym import load_environment as load_reasoning_gym

            environment = load_reasoning_gym(tasks=spec[len(REASONING_GYM_PREFIX) :], tokenizer=tokenizer, **kwargs)
        elif is_v1_environment(spec):
            from verifiers_rl.envs.adapters.verifiers_v1 import V1Env

            if tokenizer is None:
                raise ValueError(f"Environment {spec!r} is a verifiers v1 environment: pass the policy's tokenizer.")
            if tool_mode != "auto":
                raise ValueError(f"--tool_mode {tool_mode} cannot reach {spec!r}: a verifiers v1 environment's train "
                                 "client renders tools itself. Leave --tool_mode at auto.")
            environment = V1Env(spec, tokenizer, **kwargs)
        else:
            loader = _loader(spec)
            given = {"tokenizer": tokenizer} if tokenizer is not None and _takes_tokenizer(loader) else {}
            environment = loader(**given, **kwargs)
        if _is_verifiers_environment(environment):
            from verifiers_rl.envs.adapters.verifiers_env import VerifiersEnv

            if tokenizer is None:
                raise ValueError(f"Environment {spec!r} is a verifiers environment: pass the policy's tokenizer.")
            _say_unread_verifiers_args(spec, environment, loader, kwargs)
            environment = VerifiersEnv(environment, tokenizer)
    return environment


def _loader(spec: str) -> Any:
    if spec.endswith(".py") or Path(spec).is_file():
        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(f"Environment file {spec!r} does not exist.")
        return _from_file(path)
    if ":" in spec:
        return _from_module(spec)
    if spec in BUILTINS:
        return _from_module(BUILTINS[spec])
    raise ValueError(
        f"Unknown environment {spec!r}. Built-ins: {', '.join(BUILTINS)}; or pass 'reasoning_gym:<task>', "
        "'vf:<verifiers env id>', 'pkg.module:function', or the path of a .py file that defines "
        "load_environment(**kwargs)."
    )


def keyword_arguments(value: Any, flag: str) -> dict[str, Any]:
    """``value`` (a flag's parsed JSON) as a loader's keyword arguments: it must be a JSON object."""
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object of the loader's keyword arguments, e.g. "
                         f"'{{\"num_examples\": 100}}'; got {json.dumps(value)}.")
    return value


@contextlib.contextmanager
def loader_errors_named(flag: str, spec: str, given_args: bool = False) -> Iterator[None]:
    """Inside: an error from loading ``spec`` is a ValueError naming ``flag``, which the commands print as one line:
    the loader's own, of any type, with where it was raised (``core.errors.raised_at``); a missing file; a TypeError
    (a call the loader's signature refuses, a loader returning what is not an environment; ``given_args``: whether
    ``{flag}_args`` were given, which a TypeError may come from). verifiers_rl's own ValueError already says what to
    change, and its other errors are its bugs: both are left as they are."""
    try:
        yield
    except Exception as error:
        where = raised_at(error)
        if where is None and not isinstance(error, (TypeError, FileNotFoundError)):
            raise
        hint = ""
        if isinstance(error, TypeError) and given_args:
            hint = f" (its arguments come from {flag}_args{': one of the wrong type?' if where else ''})"
        raised = f"loading it raised {type(error).__name__} at {where}: " if where else ""
        raise ValueError(f"{flag} {spec}: {raised}{error}{hint}") from error
