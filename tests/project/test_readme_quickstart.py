"""README's quick start, as a new user types it: a fresh clone, a new shell with nothing of ours on
PATH, every line of the block but `make test` (that is this suite).

Cost: about 30-60 s. The clone's .venv reuses this venv's installed dependencies through a .pth
path line, so `make run` does its real install of moed (editable build, no downloads of the
dependencies) instead of minutes of fetching wheels.
"""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

ROOT = Path(__file__).parents[2]


def quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    return [re.split(r"\s{2,}#", line)[0].strip() for line in block.splitlines() if line.strip()]


def fresh_clone(dest: Path) -> Path:
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(dest)], check=True)
    subprocess.run(["git", "-C", str(dest), "checkout", "--quiet", head], check=True)
    return dest


def seed_venv(clone: Path) -> None:
    """The clone's .venv sees this venv's dependencies (not its moed): a plain path line in a
    .pth file adds the folder without running its own .pth files (this venv's editable moed)."""
    subprocess.run([sys.executable, "-m", "venv", str(clone / ".venv")], check=True)
    purelib = Path(sysconfig.get_paths(vars={"base": str(clone / ".venv")})["purelib"])
    ours = next(p for p in site.getsitepackages() if Path(p).is_dir())
    (purelib / "_deps_of_the_test_venv.pth").write_text(ours + "\n")


def test_readme_quick_start_in_a_new_shell(tmp_path):
    commands = quick_start_commands()
    assert commands[0] == "make run" and commands[-1] == "make test"
    script = "\n".join(["set -e", *commands[:-1]])  # `make test` is this very suite
    clone = fresh_clone(tmp_path / "moed")
    seed_venv(clone)
    short = Path(f"/tmp/moedq-{os.getpid()}")
    env = {
        "HOME": os.environ.get("HOME", str(tmp_path)),
        # The user's python3 (this venv's base interpreter) and the system; nothing of ours.
        "PATH": f"{Path(sys.base_prefix) / 'bin'}:/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "DEMO_DIR": str(short / "demo"),  # make run's own socket, private to this test
        # Where `moe run` starts its daemon: a directory of its own, since the daemon refuses a
        # socket directory it finds open to others (make run made `short` as a plain parent).
        "MOED_SOCKET": str(short / "run" / "s.sock"),
        **{k: v for k, v in os.environ.items() if k.startswith(("MOED_STATE", "MOED_LOG", "PIP_"))},
        "MOED_CONFIG": str(tmp_path / "none.toml"),
    }
    try:
        out = subprocess.run(
            ["bash", "--noprofile", "--norc", "-c", script],
            cwd=clone,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        text = out.stdout + out.stderr
        assert out.returncode == 0, text[-4000:]
    finally:
        moe = clone / ".venv" / "bin" / "moe"
        if moe.exists() and (short / "run" / "s.sock").exists():
            subprocess.run([str(moe), "stop"], env=env, capture_output=True, timeout=60)
        shutil.rmtree(short, ignore_errors=True)
    assert "[moe] 120 tokens" in text  # make run streamed the demo with its telemetry line
    assert "demo model" in text and "MODEL_CARD.md" in text  # the toy is explained where it speaks
    assert re.search(r"demo_model\s+ready", text), "moe ps shows the loaded demo model"
    assert "daemon stopping" in text
    # make run is quiet (pip's lines only with VERBOSE=1) and installs the demo's needs alone:
    # the test extras (pytest, ruff, mypy, the SDKs) wait for make test.
    assert "Requirement already satisfied" not in text and "Successfully" not in text
    stamps = [f.name for f in (clone / ".venv").glob(".installed-*")]
    assert len(stamps) == 1 and not stamps[0].startswith(".installed-test-"), stamps
    # The install is clean: no setuptools warnings (this machine's pip index notes are not ours).
    ours = [
        line
        for line in text.splitlines()
        if re.search(r"warning", line, re.I) and "Location 'file:" not in line
    ]
    assert not ours, "\n".join(ours)
