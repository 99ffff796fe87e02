"""One rank's status as rank 0 aggregates it for `moe status --json` (plain data, JSON-safe)."""

from __future__ import annotations

import os
import socket

import mlx.core as mx

from moed.daemon.distributed.rank_model import RankModel

_STREAM_KEYS = (
    "hit_rate",
    "hits",
    "misses",
    "reads",
    "bytes_read",
    "resident_bytes",
    "budget_bytes",
    "experts_bytes",
    "slots_per_layer",
    "tokens",
    "stall_s",
)


def rank_status(
    rank: RankModel, link: dict, cache_lists: int | None = None, prefix_disk: dict | None = None
) -> dict:
    """`cache_lists`: the batch cache lists this rank holds (rank 0's live, a follower's twins);
    0 once every request has ended. `prefix_disk`: a follower's SSD files of its layers."""
    import psutil

    out = {
        "rank": rank.layers.rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "layers": [rank.layers.start, rank.layers.end],
        "num_layers": rank.layers.end - rank.layers.start,
        "resident_weight_bytes": rank.resident_weight_bytes,
        "rss_bytes": psutil.Process().memory_info().rss,
        "mlx_active_bytes": mx.get_active_memory(),
        "mlx_peak_bytes": mx.get_peak_memory(),
        "link": link,
    }
    if cache_lists is not None:
        out["cache_lists"] = cache_lists
    if prefix_disk is not None:
        out["prefix_disk"] = prefix_disk
    if rank.streamer is not None:
        snap = rank.streamer.snapshot()
        out["experts"] = {k: snap[k] for k in _STREAM_KEYS if k in snap}
    return out
