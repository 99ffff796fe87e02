"""The embedded demo model: a small qwen3_moe trained on the Python standard library.

It ships inside the package so the first `moed serve` works offline; see MODEL_CARD.md and
training/train_demo.py for how it was made.
"""

from __future__ import annotations

from pathlib import Path


def demo_model_path() -> Path:
    """The checkpoint folder (stock mlx-lm layout, loadable by `mlx_lm.load`)."""
    return Path(__file__).resolve().parent / "demo_model"
