"""What one model's memory plan holds beyond the process's own: the unit the daemon's shared
models budget counts (transport/model_set.py) and `moed bench switch` sizes its budget by."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from moed.daemon.config import ServeConfig
from moed.daemon.experts.budget import CacheBudget
from moed.daemon.experts.memory_plan import plan_memory
from moed.daemon.model.loader import streaming_config
from moed.protocol.model_config import ModelConfig


def model_footprint(serve: ServeConfig, path: Path, capacity: int) -> int:
    """What a model's memory plan holds beyond the process's own, within `capacity` (an auto
    budget takes all of it; a resident model holds every expert)."""
    if serve.resident:
        serve = dataclasses.replace(serve, cache_budget=CacheBudget.parse("100%"))
    cfg = streaming_config(serve, ModelConfig.read(path))
    share = (capacity, capacity, "the loaded models' share")
    return plan_memory(path, cfg, baseline_bytes=0, memory=share).required_bytes
