"""The package's layers, by folder: each part imports only the parts below it (so no import cycle between parts),
and no class grows past 300 lines without saying why. The tests mirror the package: a part's unit tests in its folder.

    vllm_worker, v1_worker  <  core  <  compat  <  envs  <  inference  <  rollouts  <  config  <  training  <  cli
    (and ``python -m verifiers_rl``, the command, on top)

``vllm_worker`` and ``v1_worker`` run in other venvs (a vLLM server, verifiers 0.4) and import nothing of ours; the
client side reads their protocol constants. A new module is covered by the folder it is put in.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "verifiers_rl"
LAYERS = [{"vllm_worker", "v1_worker"}, {"core"}, {"compat"}, {"envs"}, {"inference"}, {"rollouts"}, {"config"},
          {"training"}, {"cli"}, {"__main__"}]
LEAVES = {"vllm_worker", "v1_worker"}  # import nothing of ours


def part_of(module: str) -> str | None:
    """``verifiers_rl.training.loss`` -> ``training``; ``verifiers_rl`` itself -> None."""
    parts = module.split(".")
    return parts[1] if parts[0] == "verifiers_rl" and len(parts) > 1 else None


def imported_parts(source: str, package: tuple[str, ...]) -> set[str]:
    """The parts of verifiers_rl that ``source`` (a file of ``package``) imports, relative imports resolved."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        modules = []
        if isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if module == "verifiers_rl":  # from verifiers_rl import training
                modules = [f"verifiers_rl.{alias.name}" for alias in node.names]
            else:
                modules = [module]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        found.update(part for part in map(part_of, modules) if part)
    return found


def layer(part: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if part in names)


def test_every_part_has_a_layer():
    parts = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    parts |= {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    missing = sorted(part for part in parts if not any(part in names for names in LAYERS))
    assert not missing, f"give these a place in LAYERS: {missing}"


def test_each_part_imports_only_the_parts_below_it():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        part = rel.parts[0] if len(rel.parts) > 1 else path.stem
        if part == "__init__":
            continue  # the package's lazy exports (PEP 562) name every part
        package = ("verifiers_rl", *rel.parts[:-1])
        for other in imported_parts(path.read_text(), package) - {part}:
            if part in LEAVES or layer(other) >= layer(part):
                wrong.append(f"{rel} ({part}) imports {other}")
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_an_upward_import():
    source = ("from ...training.forward import unwrap\nfrom ... import rollouts\nimport verifiers_rl.cli.train\n"
              "from .engine import Sample\nfrom verifiers_rl.core.rollout import Rollout\n")
    assert imported_parts(source, ("verifiers_rl", "inference", "embedded")) == {
        "training", "rollouts", "cli", "inference", "core"}


MAX_CLASS_LINES = 300
SIZE_REASON = "Over 300 lines:"


def test_no_class_is_over_300_lines_without_its_reason():
    """A class that grows past 300 lines is split, or says why not in its docstring (a line opening with
    ``Over 300 lines:``)."""
    unexplained = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                doc = ast.get_docstring(node) or ""
                if not any(line.strip().startswith(SIZE_REASON) for line in doc.splitlines()):
                    unexplained.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} "
                                       f"({node.end_lineno - node.lineno + 1} lines)")
    assert not unexplained, f"split these or give the reason ({SIZE_REASON!r}): {unexplained}"


TESTS = Path(__file__).parent
# Test folders that are no part of the package: several parts together, the whole command, the shared helpers, and
# the tiers and launched programs kept in folders of their own.
OTHER_TEST_FOLDERS = {"integration", "system", "helpers", "distributed", "live", "v1", "vllm_backend", "gpu"}


def test_the_tests_mirror_the_package():
    """A unit test sits in the folder of the part it tests (tests/training/ for verifiers_rl/training/, and
    tests/test_compat.py for compat.py); each test folder is a package, so same-named modules of two folders never
    clash."""
    parts = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    folders = {p for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    strays = sorted(f"tests/{p.name}/" for p in folders if p.name not in parts | OTHER_TEST_FOLDERS)
    assert not strays, f"{', '.join(strays)}: no part of verifiers_rl/ has this name (a part's tests go in its folder)"
    modules = {f"test_{p.stem}.py" for p in PACKAGE.glob("*.py")} | {Path(__file__).name}
    loose = sorted(f"tests/{p.name}" for p in TESTS.glob("test_*.py") if p.name not in modules)
    assert not loose, f"move {', '.join(loose)} into the folder of the part it tests (or tests/integration/ or system/)"
    no_package = sorted(f"tests/{p.relative_to(TESTS)}/" for p in TESTS.rglob("*")
                        if p.is_dir() and any(p.glob("test_*.py")) and not (p / "__init__.py").exists())
    assert not no_package, f"add an empty __init__.py to {', '.join(no_package)}"
