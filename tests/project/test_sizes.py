"""Small modules with one concern: no module of the project over MAX_MODULE_LINES lines, and no
class on the serving path (engine, experts, transport: what runs every request) over
MAX_CLASS_LINES (issue 35: split by concern into collaborators). Parsed with `ast`, nothing
imported."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.fixtures.import_graph import ROOT

MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 300
SERVING_PATH = ("daemon/engine", "daemon/experts", "daemon/transport")
# The code of the project: its packages and scripts; tests/ and what tools put here are not.
SKIPPED = {"tests", "build", "node_modules"}


def _modules() -> list[Path]:
    return sorted(
        path
        for path in ROOT.rglob("*.py")
        if not any(part in SKIPPED or part.startswith(".") for part in path.relative_to(ROOT).parts)
    )


def _classes(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    return [
        (node.name, (node.end_lineno or node.lineno) - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    ]


def test_no_module_is_over_the_limit():
    modules = _modules()
    assert any(p.relative_to(ROOT).as_posix() == "daemon/engine/core.py" for p in modules)
    over = {
        path.relative_to(ROOT).as_posix(): n
        for path in modules
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split by concern): {over}"


def test_no_class_on_the_serving_path_is_over_the_limit():
    sizes = {
        f"{path.relative_to(ROOT).as_posix()}:{name}": lines
        for room in SERVING_PATH
        for path in sorted((ROOT / room).rglob("*.py"))
        for name, lines in _classes(path)
    }
    assert "daemon/engine/core.py:EngineCore" in sizes  # the walk finds the serving classes
    over = {where: lines for where, lines in sizes.items() if lines > MAX_CLASS_LINES}
    assert not over, f"classes over {MAX_CLASS_LINES} lines (split by concern): {over}"
