"""The `done` telemetry keeps this request's expert counters (`experts`) apart from the daemon-wide
cache (`cache`): a second request's hit rate is its own, not the daemon's since start."""

from __future__ import annotations

import pytest

from moed.client import DoneEvent

pytestmark = pytest.mark.process


def done_of(client, prompt: str, max_tokens: int) -> DoneEvent:
    events = list(client.generate(prompt, max_tokens=max_tokens, raw=True))
    assert isinstance(events[-1], DoneEvent)
    return events[-1]


def test_done_telemetry_splits_request_counters_from_the_daemon_cache(daemon_factory, tiny_model):
    d = daemon_factory(tiny_model, "--cache-budget", "50%")
    with d.client() as c:
        done_of(c, "def first(x):", 12)
        before = c.stats()["experts"]
        second = done_of(c, "class Second:", 12)
        after = c.stats()["experts"]
    mine, cache = second.telemetry["experts"], second.telemetry["cache"]
    # This request's own counters: exactly what the daemon counted while it ran.
    assert mine["hits"] == after["hits"] - before["hits"]
    assert mine["misses"] == after["misses"] - before["misses"]
    assert mine["bytes_read"] == after["bytes_read"] - before["bytes_read"]
    assert mine["hit_rate"] == mine["hits"] / (mine["hits"] + mine["misses"])
    assert mine["layer_hits"] == [a - b for a, b in zip(after["layer_hits"], before["layer_hits"])]
    assert sum(mine["layer_hits"]) == mine["hits"]
    # Daemon-wide, named apart: the cache's gauges and its since-start rate.
    assert cache["hit_rate_since_start"] == after["hit_rate"]
    assert cache["budget_bytes"] == after["budget_bytes"] and "budget_bytes" not in mine
    assert "hits" not in cache and "layer_hits" not in cache
