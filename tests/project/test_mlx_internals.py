"""mlx-lm's internals in one module (daemon/model/mlx_compat.py lists each use, and
tests/model/test_mlx_compat.py tests each): everywhere else, checked from the code (parsed with
`ast`, nothing imported), no mlx-lm private name, no `__class__` assignment and no method rebinding
(`types.MethodType`, an instance's method replaced under `type: ignore[method-assign]`)."""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

from tests.fixtures.import_graph import ROOT, source_files

COMPAT = ROOT / "daemon" / "model" / "mlx_compat.py"
ATTR_CALLS = ("getattr", "setattr", "hasattr", "delattr")


@functools.cache
def mlx_lm_private_names() -> frozenset[str]:
    """Every underscore name mlx-lm's sources define (functions, classes, module and instance
    attributes), dunders aside: read from the installed package, not imported."""
    spec = importlib.util.find_spec("mlx_lm")
    assert spec is not None and spec.submodule_search_locations, "mlx-lm is not installed"
    names: set[str] = set()
    for path in Path(spec.submodule_search_locations[0]).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return frozenset(n for n in names if n.startswith("_") and not n.endswith("__"))


def _own(node: ast.Attribute) -> bool:
    """`self._x` / `cls._x`: the object's own attribute (moed's class), not reached into."""
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def reaches(source: str) -> list[tuple[int, str]]:
    """(line, what) for each reach past mlx-lm's public API in `source`."""
    private = mlx_lm_private_names()
    found: list[tuple[int, str]] = []
    for line, text in enumerate(source.splitlines(), 1):
        if "method-assign" in text:
            found.append((line, "a method replaced on an instance (method-assign)"))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mlx_lm":
            found += [(node.lineno, f"imports {a.name}") for a in node.names if a.name[0] == "_"]
        elif isinstance(node, ast.Attribute):
            if node.attr == "__class__" and isinstance(node.ctx, ast.Store):
                found.append((node.lineno, f"assigns {ast.unparse(node)}"))
            elif node.attr == "MethodType":
                found.append((node.lineno, "rebinds a method (types.MethodType)"))
            elif node.attr in private and not _own(node):
                found.append((node.lineno, f"reads mlx-lm's {ast.unparse(node)}"))
        elif isinstance(node, ast.alias) and node.name == "MethodType":
            found.append((getattr(node, "lineno", 0), "imports types.MethodType"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            args = node.args
            if node.func.id in ATTR_CALLS and len(args) > 1 and isinstance(args[1], ast.Constant):
                name = args[1].value
                if name == "__class__" or name in private:
                    found.append((node.lineno, f"{node.func.id}(..., {name!r})"))
    return found


def _checked_files() -> list[Path]:
    return [p for p in source_files() + sorted((ROOT / "benchmarks").glob("*.py")) if p != COMPAT]


def test_the_scan_sees_each_kind_of_reach():
    """The checker itself: each form of reach it must refuse, written the way moed once had it."""
    assert {"_tokenizer", "_prompt_batch", "_get_classes"} <= mlx_lm_private_names()
    samples = {
        "hf = getattr(tokenizer, '_tokenizer', tokenizer)": "getattr",
        "cache.__class__ = Other": "assigns",
        "batch.split = types.MethodType(f, batch)": "MethodType",
        "from types import MethodType": "MethodType",
        "b.generate = g  # type: ignore[method-assign]": "method-assign",
        "from mlx_lm.utils import _get_classes": "imports _get_classes",
        "gen._prompt_batch.uids": "_prompt_batch",
    }
    for source, what in samples.items():
        found = reaches(source)
        assert found and what in found[0][1], (source, found)
    assert reaches("self._tokenizer = None\nx = exc.__class__.__name__") == []


def test_mlx_lm_internals_only_in_mlx_compat():
    assert COMPAT.exists() and reaches(COMPAT.read_text()), "the scan finds nothing in mlx_compat"
    wrong = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path in _checked_files()
        for line, what in reaches(path.read_text())
    ]
    assert not wrong, (
        "mlx-lm reached into outside daemon/model/mlx_compat.py (name the use there and test it "
        "in tests/model/test_mlx_compat.py):\n" + "\n".join(wrong)
    )
