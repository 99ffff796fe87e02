"""The client room's fixtures: a fake Hub serving the tiny checkpoint, and the environment that
points `moe` at it."""

from __future__ import annotations

import pytest

from tests.fixtures.fake_hub import FakeHub
from tests.fixtures.hub_cli import REPO


@pytest.fixture
def hub(tiny_model):
    hub = FakeHub()
    # Files mlx-lm does not need are on the Hub too: a pull must never fetch them.
    hub.add_folder(
        REPO,
        tiny_model,
        extra={"README.md": b"# tiny\n", "pytorch_model.bin": b"\0" * 4096},
    )
    hub.start()
    yield hub
    hub.stop()


@pytest.fixture
def hf_env(hub, tmp_path):
    return {
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_XET": "1",
        "NO_PROXY": "127.0.0.1",
    }
