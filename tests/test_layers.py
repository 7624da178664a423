"""Layers point one way: the inference engines (and the vLLM worker) import nothing from the training side."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "verifiers_rl"
TRAINING = {"trainer", "steps", "run_state", "weight_sync", "step_metrics", "batching", "prefix", "policy", "loss",
            "weights", "config", "generator", "checkpoint", "evaluation", "grpo_fields"}


def imported_modules(source: str, package: tuple[str, ...]) -> set[str]:
    """The verifiers_rl modules ``source`` (a file of ``package``) imports, relative imports resolved."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - node.level + 1])
                parts = base + (node.module.split(".") if node.module else [])
            else:
                parts = (node.module or "").split(".")
            if parts and parts[0] == "verifiers_rl":
                if len(parts) > 1:
                    found.add(parts[1])
                else:  # from verifiers_rl import module (or from .. import module)
                    found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("verifiers_rl."):
                    found.add(alias.name.split(".")[1])
    return found


def test_inference_and_the_vllm_worker_import_nothing_from_training():
    for folder in ("inference", "vllm_worker"):
        for path in sorted((PACKAGE / folder).glob("*.py")):
            wrong = imported_modules(path.read_text(), ("verifiers_rl", folder)) & TRAINING
            assert not wrong, f"{path.relative_to(PACKAGE.parent)} imports {sorted(wrong)} from the training side"


def test_the_check_sees_an_import_of_the_training_side():
    source = "from ..policy import unwrap\nfrom .. import trainer\nimport verifiers_rl.loss\nfrom .engine import Sample\n"
    assert imported_modules(source, ("verifiers_rl", "inference")) == {"policy", "trainer", "loss", "inference"}


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
