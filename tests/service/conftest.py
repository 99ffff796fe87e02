"""The service room's fixtures: the recording stand-ins for the service managers on PATH."""

from __future__ import annotations

import json
import sys

import pytest

from tests.fixtures.service_tools import FAKE_TOOL


@pytest.fixture
def fake_tools(tmp_path):
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    script = FAKE_TOOL.replace("#!PYTHON", f"#!{sys.executable}")
    for name in ("launchctl", "systemctl", "journalctl", "tail"):
        path = bin_dir / name
        path.write_text(script)
        path.chmod(0o755)
    state = tmp_path / "fakestate"

    def calls() -> list[list[str]]:
        file = state / "calls.jsonl"
        return [json.loads(line) for line in file.read_text().splitlines()] if file.exists() else []

    return bin_dir, state, calls
