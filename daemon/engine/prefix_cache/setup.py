"""The prefix cache of a loaded model, built from the serve settings (None when it is off)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, cast

from mlx_lm.models.cache import make_prompt_cache

from moed.daemon.config import ServeConfig
from moed.daemon.distributed.rank_disk import LeaderDisk, rank_disk_place
from moed.daemon.engine.prefix_cache.cache import PrefixCache, PrefixCacheConfig
from moed.daemon.engine.prefix_cache.disk_tier import DiskTier
from moed.daemon.experts.budget import parse_size
from moed.daemon.experts.memory_plan import auto_prefix_cache_bytes, machine_memory
from moed.daemon.model.cache_file import model_fingerprint
from moed.daemon.model.layer_caches import trimmable_layers

if TYPE_CHECKING:  # types only: the functions below import what they run
    import mlx.nn as nn

    from moed.daemon.distributed.leader import PipelineLeader
    from moed.daemon.experts.memory_plan import MemoryPlan
    from moed.daemon.model.loader import LoadedModel

log = logging.getLogger("moed.prefix_cache")


def memory_tier_bytes(serve: ServeConfig, plan: MemoryPlan | None, share: float = 1.0) -> int:
    """The memory tier's budget: as set, or the memory plan's automatic share (`plan` None: a
    resident model, planned against the machine the same way). A pipeline's rank 0 counts only
    its own layers' caches: its `share` of the layers, of a size set for the whole group."""
    if serve.prefix_cache_bytes != "auto":
        return int(parse_size(serve.prefix_cache_bytes) * share)
    if plan is not None:
        return plan.prefix_cache_bytes
    limit = serve.memory_limit_bytes
    return auto_prefix_cache_bytes(limit or machine_memory()[1])


def prefix_cache_config(
    serve: ServeConfig, plan: MemoryPlan | None = None, share: float = 1.0
) -> PrefixCacheConfig:
    return PrefixCacheConfig(
        memory_bytes=memory_tier_bytes(serve, plan, share),
        disk_bytes=parse_size(serve.prefix_cache_disk_bytes),
        disk_dir=serve.prefix_cache_folder,
        # Chunk boundaries: a checkpoint lands where a chunk ends anyway.
        checkpoint_every=-(-serve.prefix_checkpoint_tokens // serve.prefill_chunk)
        * serve.prefill_chunk,
        min_split=serve.prefill_chunk,
    )


def open_prefix_cache(
    serve: ServeConfig, loaded: LoadedModel, model_path: Path
) -> PrefixCache | None:
    plan = loaded.streamer.plan if loaded.streamer else None
    if loaded.pipeline is not None:  # every rank keeps its own layers of each entry (cache_ops.py)
        leader = cast("PipelineLeader", loaded.pipeline)  # rank 0's: distributed/rank0.py made it
        share = leader.rank.layers.share
        cfg = prefix_cache_config(serve, plan, share)
        if not cfg.enabled:
            return None
        trimmable = leader.cache_trimmable()
        pipeline_disk = None
        if cfg.disk_bytes > 0:  # each rank's files of its layers, in a folder of its own
            folder, fingerprint = rank_disk_place(cfg.disk_dir, model_path, leader.rank)
            pipeline_disk = DiskTier(
                folder, int(cfg.disk_bytes * share), fingerprint, trimmable, LeaderDisk(leader)
            )
        return PrefixCache(cfg, trimmable, pipeline_disk)
    cfg = prefix_cache_config(serve, plan)
    if not cfg.enabled:
        return None
    layers = make_prompt_cache(cast("nn.Module", loaded.model))
    trimmable = trimmable_layers(layers)
    disk = None
    if cfg.disk_bytes > 0:
        fingerprint = model_fingerprint(model_path, [type(c).__name__ for c in layers])
        disk = DiskTier(cfg.disk_dir, cfg.disk_bytes, fingerprint, trimmable)
    return PrefixCache(cfg, trimmable, disk)
