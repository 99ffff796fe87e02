"""The package list in pyproject.toml covers every package folder (a wheel install would miss
one)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from moed.daemon.service.render import Role, ServiceManager, template_file

ROOT = Path(__file__).parents[2]


def test_every_package_folder_is_listed():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = set()
    for prefix, folder in tool["package-dir"].items():
        # Every folder counts, with or without __init__.py: Python imports a data folder as a
        # namespace package, and setuptools warns at every install about one not listed.
        for sub in [ROOT / folder, *(ROOT / folder).rglob("*")]:
            rel = sub.relative_to(ROOT / folder)
            if not sub.is_dir() or "__pycache__" in rel.parts:
                continue
            found.add(".".join([prefix, *rel.parts]))
    assert found <= listed, f"add to pyproject.toml packages: {sorted(found - listed)}"


def _package_folder(tool: dict, package: str) -> Path:
    """A package's source folder under the package-dir mapping (moed.daemon.x -> daemon/x)."""
    for prefix, folder in sorted(tool["package-dir"].items(), key=lambda kv: -len(kv[0])):
        if package == prefix or package.startswith(prefix + "."):
            return ROOT / folder / Path(*package[len(prefix) :].split(".")[1:])
    raise AssertionError(f"{package} is under no package-dir prefix")


def test_service_templates_are_package_data():
    # A wheel carries only what [tool.setuptools.package-data] matches: every template must be.
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for manager in ServiceManager:
        for role in Role:
            path = Path(str(template_file(manager, role)))
            assert path.is_file(), path
            shipped = [
                package
                for package, globs in tool["package-data"].items()
                if path.is_relative_to(_package_folder(tool, package))
                and any(path.relative_to(_package_folder(tool, package)).match(g) for g in globs)
            ]
            assert shipped, f"{path} is not matched by [tool.setuptools.package-data]"
