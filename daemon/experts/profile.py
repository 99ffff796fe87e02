"""The expert-usage profile: how often each layer routed to each expert, kept across restarts in
the state directory so the next start can warm the cache with the experts that matter."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from moed.daemon.runtime.state_files import read_json, write_json_atomic

VERSION = 1


def profile_path(state_dir: Path, model_path: Path) -> Path:
    key = hashlib.sha256(str(Path(model_path).resolve()).encode()).hexdigest()[:16]
    return Path(state_dir) / "profiles" / f"experts-{key}.json"


def save_profile(path: Path, model_path: Path, counts: list[np.ndarray]) -> None:
    write_json_atomic(
        path,
        {
            "version": VERSION,
            "model_path": str(Path(model_path).resolve()),
            "layers": [[int(c) for c in layer] for layer in counts],
        },
    )


def load_profile(path: Path, num_experts: list[int]) -> list[np.ndarray] | None:
    """The saved counts, or None when missing, corrupt or for another layout."""
    data = read_json(path)
    if not isinstance(data, dict) or data.get("version") != VERSION:
        return None
    layers = data.get("layers")
    if not isinstance(layers, list) or [len(l) for l in layers] != list(num_experts):
        return None
    try:
        return [np.asarray(l, dtype=np.int64) for l in layers]
    except (TypeError, ValueError):
        return None


def merge(saved: list[np.ndarray] | None, current: list[np.ndarray]) -> list[np.ndarray]:
    if saved is None:
        return [c.copy() for c in current]
    return [s + c for s, c in zip(saved, current)]
