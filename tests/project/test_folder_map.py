"""ARCHITECTURE.md's folder map names every top-level folder the repository tracks."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What a build, an install or a run leaves beside the sources (.gitignore's folders).
BUILT = {"build", "bench-out", "__pycache__"}


def test_every_top_level_folder_is_in_the_folder_map():
    folders = {
        p.name
        for p in ROOT.iterdir()
        if p.is_dir()
        and not p.name.startswith(".")  # .ci, .git, .venv, tool caches
        and p.name not in BUILT
        and not p.name.endswith(".egg-info")
    }
    text = (ROOT / "ARCHITECTURE.md").read_text()
    block = text.split("## Folder map", 1)[1].split("```")[1]
    named = set(re.findall(r"^([\w.-]+)/", block, flags=re.MULTILINE))
    assert folders - named == set(), f"add these to ARCHITECTURE.md's folder map: {folders - named}"
