"""Expert streaming: run MoE models larger than memory, token-identical to the resident model.

The engine calls `install_streaming(model, path, cfg)` on a lazily loaded mlx-lm model; every
SwitchGLU / SwitchMLP becomes a streaming twin backed by per-layer slot pools that prefetch
workers fill with `os.preadv` straight from the safetensors files.

The names below load on first use (PEP 562), so that the MLX-free parts (`policies`, `slots`,
`budget`) import without MLX: the configuration validates policy names with the registry.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> the module that defines it
_EXPORTS = {
    "BudgetError": "moed.daemon.experts.budget",
    "parse_budget": "moed.daemon.experts.budget",
    "CUMULATIVE_KEYS": "moed.daemon.experts.counters",
    "MemoryPlan": "moed.daemon.experts.memory_plan",
    "estimate_kv_bytes": "moed.daemon.experts.memory_plan",
    "machine_memory": "moed.daemon.experts.memory_plan",
    "plan_memory": "moed.daemon.experts.memory_plan",
    "CheckpointError": "moed.daemon.experts.safetensors_index",
    "CheckpointIndex": "moed.daemon.experts.safetensors_index",
    "TensorLoc": "moed.daemon.experts.safetensors_index",
    "ExpertStreamer": "moed.daemon.experts.streamer",
    "StreamingConfig": "moed.daemon.experts.streaming_config",
    "install_streaming": "moed.daemon.experts.install",
    "EvictionPolicy": "moed.daemon.experts.policies",
    "LRUPolicy": "moed.daemon.experts.policies",
    "PageCachePolicy": "moed.daemon.experts.store",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = vars(importlib.import_module(module))[name]
    globals()[name] = value  # the next lookup is a plain module attribute
    return value
