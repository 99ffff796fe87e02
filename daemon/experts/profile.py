"""The expert-usage profile: how often each layer routed to each expert, kept across restarts in
the state directory so the next start can warm the cache with the experts that matter."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from moed.daemon.ground.state_files import read_json, save_json

VERSION = 1


def profile_path(state_dir: Path, model_path: Path) -> Path:
    key = hashlib.sha256(str(Path(model_path).resolve()).encode()).hexdigest()[:16]
    return Path(state_dir) / "profiles" / f"experts-{key}.json"


def save_profile(path: Path, model_path: Path, counts: list[np.ndarray]) -> None:
    save_json(
        path,
        {
            "version": VERSION,
            "model_path": str(Path(model_path).resolve()),
            "layers": [[int(c) for c in layer] for layer in counts],
        },
    )


def load_profile(path: Path, num_experts: list[int]) -> list[np.ndarray] | None:
    """The saved counts, or None when missing or for another layout (misshapen: set aside)."""
    data = read_json(path, shape=_profile_shape)
    if data is None or data.get("version") != VERSION:
        return None
    layers = data["layers"]
    if [len(layer) for layer in layers] != list(num_experts):
        return None  # another model's layout: a valid file, just not for this one
    return [np.asarray(layer, dtype=np.int64) for layer in layers]


def _profile_shape(data: Any) -> bool:
    layers = data.get("layers")
    return (
        isinstance(data, dict)
        and isinstance(layers, list)
        and all(
            isinstance(layer, list)
            and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in layer)
            for layer in layers
        )
    )


def merge(saved: list[np.ndarray] | None, current: list[np.ndarray]) -> list[np.ndarray]:
    if saved is None:
        return [c.copy() for c in current]
    return [s + c for s, c in zip(saved, current)]


def hottest(counts: list[np.ndarray], slots: list[int]) -> list[list[int]]:
    """Per layer, its `slots` most used experts, least used first (so the eviction order keeps
    the most used longest); experts never used are not chosen."""
    chosen = []
    for layer_counts, n in zip(counts, slots):
        used = np.flatnonzero(layer_counts)
        top = used[np.argsort(-layer_counts[used], kind="stable")][:n]
        chosen.append(sorted(top.tolist(), key=lambda e: layer_counts[e]))
    return chosen
