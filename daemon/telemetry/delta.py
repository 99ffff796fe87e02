"""Per-request expert telemetry: cumulative streamer counters as differences since the request
began."""

from __future__ import annotations

from typing import Any

from moed.daemon.experts.counters import CUMULATIVE_KEYS


def counters_delta(before: dict | None, after: dict | None) -> dict:
    """Per-request telemetry: numeric counters as differences, everything else as the latest
    value."""
    if not after:
        return {}
    before = before or {}
    out: dict[str, Any] = {}
    for name, value in after.items():
        prior = before.get(name)
        if (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and isinstance(prior, (int, float))
        ):
            out[name] = value - prior if name in CUMULATIVE_KEYS else value
        else:
            out[name] = value
    return out
