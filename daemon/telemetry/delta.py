"""Expert telemetry of a request, split in two maps named apart:

- `experts`: this request's own counters, the cumulative streamer counters as differences since
  it began, and the hit rates computed from those differences;
- `cache`: the daemon-wide expert cache it ran against (gauges such as the budget, and the hit
  rate since the daemon started, `hit_rate_since_start`).
"""

from __future__ import annotations

from typing import Any

from moed.daemon.experts.counters import CUMULATIVE_KEYS

# Per-layer cumulative lists: differenced element by element.
LAYER_KEYS = ("layer_hits", "layer_misses")
# Rates the snapshot derives from cumulative counters: recomputed from the differences.
RATE_KEYS = ("hit_rate", "layer_hit_rates")


def _rate(hits: float, misses: float) -> float:
    return hits / (hits + misses) if hits + misses else 0.0


def request_counters(before: dict | None, after: dict | None) -> dict:
    """This request's expert counters: what accumulated between two streamer snapshots."""
    if not after:
        return {}
    before = before or {}
    out: dict[str, Any] = {}
    for name in CUMULATIVE_KEYS:
        if isinstance(after.get(name), (int, float)):
            out[name] = after[name] - (before.get(name) or 0)
    for name in LAYER_KEYS:
        now, then = after.get(name) or [], before.get(name) or []
        out[name] = [a - (then[i] if i < len(then) else 0) for i, a in enumerate(now)]
    out["hit_rate"] = _rate(out.get("hits", 0), out.get("misses", 0))
    out["layer_hit_rates"] = [_rate(h, m) for h, m in zip(out["layer_hits"], out["layer_misses"])]
    return out


def cache_state(after: dict | None) -> dict:
    """The daemon-wide cache: every gauge of the snapshot, and its since-start hit rate."""
    if not after:
        return {}
    skip = CUMULATIVE_KEYS | set(LAYER_KEYS) | set(RATE_KEYS)
    out = {name: value for name, value in after.items() if name not in skip}
    out["hit_rate_since_start"] = after.get("hit_rate")
    return out
