"""Expert streaming: run MoE models larger than memory, token-identical to the resident model.

The engine calls `install_streaming(model, path, cfg)` on a lazily loaded mlx-lm model; every
SwitchGLU / SwitchMLP becomes a streaming twin backed by per-layer slot pools that prefetch
workers fill with `os.preadv` straight from the safetensors files.
"""

from moed.daemon.config import PageCachePolicy
from moed.daemon.experts.budget import BudgetError, parse_budget
from moed.daemon.experts.cache import EvictionPolicy, LRUPolicy
from moed.daemon.experts.counters import CUMULATIVE_KEYS
from moed.daemon.experts.memory_plan import (
    MemoryPlan,
    estimate_kv_bytes,
    machine_memory,
    plan_memory,
)
from moed.daemon.experts.safetensors_index import CheckpointError, CheckpointIndex, TensorLoc
from moed.daemon.experts.streamer import ExpertStreamer, StreamingConfig, install_streaming

__all__ = [
    "BudgetError",
    "CUMULATIVE_KEYS",
    "CheckpointError",
    "CheckpointIndex",
    "EvictionPolicy",
    "ExpertStreamer",
    "LRUPolicy",
    "MemoryPlan",
    "PageCachePolicy",
    "StreamingConfig",
    "TensorLoc",
    "estimate_kv_bytes",
    "install_streaming",
    "machine_memory",
    "parse_budget",
    "plan_memory",
]
