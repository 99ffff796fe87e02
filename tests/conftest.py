"""Shared pytest fixtures. Helpers first; append new fixtures below, one block per concern."""

from __future__ import annotations

from pathlib import Path

import pytest

from fixtures.checkpoints import write_checkpoint

# --- tiny MoE checkpoints -------------------------------------------------------------------


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """`checkpoint_factory(arch, **write_checkpoint_kwargs) -> Path`, written once per session.

    Checkpoints are cached by their arguments, so tests asking for the same model share one
    directory: treat it as read-only.
    """
    cache: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("checkpoints")

    def make(arch: str = "qwen3_moe", **kwargs) -> Path:
        key = (arch, *sorted(kwargs.items()))
        if key not in cache:
            name = "-".join([arch, *(f"{k}{v}" for k, v in sorted(kwargs.items()))])
            cache[key] = write_checkpoint(root / name, arch, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(checkpoint_factory) -> Path:
    """A float32 qwen3_moe checkpoint: 2 MoE layers, 8 experts, top-2, hidden 64."""
    return checkpoint_factory("qwen3_moe")
