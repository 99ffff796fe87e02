"""Each served model's own figures in the `stats` body (`models`): its requests, tokens, expert
cache and prefix cache, which Prometheus labels by `model` and `moe stats` lists by name.

The transport builds a `ModelFigures` per model it serves (loaded or not: a counter must not
vanish while its model is unloaded); this module reads them without knowing the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

SampleValues = tuple[int, int, int, int]  # tokens generated, expert bytes read, hits, misses


class StatusView(Protocol):
    """What is read of a model's engine status (engine/status.py's EngineStatus)."""

    def get(self, name: str) -> Any: ...

    def snapshot(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ModelFigures:
    """One served model as the transport sees it now."""

    name: str
    status: StatusView
    streamer: Any  # its ExpertStreamer; None when unloaded or resident
    pending: int  # its admitted generations not yet finished
    loaded: bool  # loaded, or a load decided and under way


def sample_values(tokens: int, streamer: Any) -> SampleValues:
    """The counters the rate sampler keeps for one engine."""
    if streamer is None:
        return tokens, 0, 0, 0
    c = streamer.counters
    return tokens, c.bytes_read, sum(l.hits for l in c.layers), sum(l.misses for l in c.layers)


def model_stats(fig: ModelFigures, experts: dict | None, rates: dict) -> dict:
    """One entry of the `stats` body's `models`: the keys of the body's own per-engine figures
    (requests, tokens, experts, prefix_cache), under the model's name."""
    snap = fig.status.snapshot()
    if experts is not None:
        experts["recent_hit_rate"] = rates.get("hit_rate")
        experts["recent_bytes_read_per_s"] = rates.get("bytes_read_per_s")
    return {
        "name": fig.name,
        "loaded": fig.loaded,
        "state": snap.get("state"),
        "requests": {
            "served": snap.get("requests_served", 0),
            "failed": snap.get("requests_failed", 0),
            "active": snap.get("active_requests", 0),
            "pending": fig.pending,
            "queued": snap.get("queued_requests", 0),
        },
        "tokens": {
            "generated": snap.get("tokens_generated", 0),
            "per_s": rates.get("tokens_per_s"),
            "window_s": rates.get("window_s"),
        },
        "experts": experts,
        "prefix_cache": snap.get("prefix_cache"),
    }
