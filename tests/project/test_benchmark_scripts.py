"""The scripts in benchmarks/ run against the package as it is now: each imports (a rename in the
package once left prompt_exactness.py failing at its first line, unnoticed until a GPU run)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).parents[2] / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_a_benchmark_script_imports(script):
    spec = importlib.util.spec_from_file_location(f"benchmark_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # each runs its measurement only under __main__
    assert callable(getattr(module, "main", None))
