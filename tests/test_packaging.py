"""The package list in pyproject.toml covers every package folder (a wheel install would miss
one)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_every_package_folder_is_listed():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = set()
    for prefix, folder in tool["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            if "__pycache__" in rel.parts:
                continue
            found.add(".".join([prefix, *rel.parts]))
    assert found <= listed, f"add to pyproject.toml packages: {sorted(found - listed)}"
