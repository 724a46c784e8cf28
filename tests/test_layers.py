"""The launch path's layers (README, "The code"): cli -> pipeline, launch -> runtime -> stages.
Nothing imports upward: a stage never knows which launcher started it nor how the chain of
stages is planned, so the commands that run in the CLI's process (stage=init's cluster file and
preflight, stage=tune's train launches) live in cli/, not in stages/."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = REPO / "orchestrator"

# A part of the package -> the parts above it, which none of its modules may import.
ABOVE = {
    "stages": ("cli", "pipeline", "launch", "runtime"),
    "runtime": ("cli", "pipeline", "launch"),
    "launch": ("cli", "pipeline"),
    "pipeline": ("cli", "launch", "runtime"),
}


def imported_parts(path: Path, package_dir: Path = PACKAGE) -> set:
    """The first-level parts of `orchestrator` (sub-packages, top-level modules) that the module
    at `path` (inside `package_dir`) imports, at any depth (a function's own imports too),
    absolute or relative."""
    here = path.relative_to(package_dir.parent).with_suffix("").parts
    package = here if path.name == "__init__.py" else here[:-1]
    parts = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (".".join(package[:len(package) - node.level + 1]) + "." if node.level
                    else "")
            module = base + (node.module or "")
            names = [module] + [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        parts |= {n.split(".")[1] for n in names if n.startswith("orchestrator.")}
    return parts


def test_imported_parts_reads_absolute_relative_and_nested_imports(tmp_path):
    module = tmp_path / "orchestrator" / "stages" / "x.py"
    module.parent.mkdir(parents=True)
    module.write_text("import orchestrator.store\nfrom ..launch import slurm\n"
                      "from . import Stage\n"
                      "def f():\n    from orchestrator import pipeline\n")
    assert imported_parts(module, tmp_path / "orchestrator") == {"store", "launch", "pipeline",
                                                                 "stages"}


@pytest.mark.parametrize("part", sorted(ABOVE))
def test_no_module_imports_a_layer_above_its_own(part):
    upward = {f"{path.relative_to(REPO)} imports orchestrator.{above}"
              for path in sorted((PACKAGE / part).rglob("*.py"))
              for above in ABOVE[part] if above in imported_parts(path)}
    assert not upward, sorted(upward)


def _part_graph() -> dict:
    """First-level part -> the other parts its modules import."""
    graph: dict = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).with_suffix("").parts
        if rel[0] in ("__init__", "__main__"):
            continue
        graph.setdefault(rel[0], set()).update(imported_parts(path) - {rel[0]})
    return graph


def test_no_two_parts_of_the_package_import_each_other():
    """No package-level import cycle (planner <-> interop and models <-> workload were the last):
    a part never reaches itself through what it imports."""
    graph = _part_graph()

    def reach(start):
        seen, todo = set(), list(graph.get(start, ()))
        while todo:
            part = todo.pop()
            if part not in seen:
                seen.add(part)
                todo.extend(graph.get(part, ()))
        return seen
    cyclic = sorted(part for part in graph if part in reach(part))
    assert not cyclic, f"parts on an import cycle: {cyclic}"
