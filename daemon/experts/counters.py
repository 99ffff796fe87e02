"""Cumulative counters of the expert streamer. Snapshots are plain types (msgpack-able)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Snapshot keys that accumulate (per-request telemetry reports their differences); others are
# gauges.
CUMULATIVE_KEYS = frozenset(
    {
        "hits",
        "misses",
        "tokens",
        "steps",
        "host_syncs",
        "fences",
        "overlapped",
        "layer_calls",
        "device_routed",
        "passes",
        "bytes_read",
        "reads",
        "evictions",
        "lane_loads",
        "read_s",
        "stall_s",
        "router_readback_s",
        "router_sync_s",
        "router_copy_s",
        "expert_compute_s",
        "layer_s",
        "layer_python_s",
        "prefetched",
        "prefetch_hits",
        "prefetch_dropped",
        "prefetch_cancelled_bytes",
        "prefetch_bytes",
        "prompt_end_reads",
        "prompt_end_hits",
        "warm_bytes",
        "warm_s",
    }
)


@dataclass
class LayerCounters:
    hits: int = 0
    misses: int = 0
    device_hits: int = 0  # hits of calls routed on the device (held.py), as last folded

    @property
    def all_hits(self) -> int:
        return self.hits + self.device_hits


@dataclass
class Counters:
    layers: list[LayerCounters] = field(default_factory=list)
    tokens: int = 0  # token rows seen by the first MoE layer
    steps: int = 0  # forward passes (calls of the first MoE layer): one per decode token
    host_syncs: int = 0  # evaluations the streaming layers forced (router read-backs + fences)
    fences: int = 0  # ... of them evaluating pending outputs before a slot they read was reused
    overlapped: int = 0  # layer calls that computed resident experts' rows during the reads
    layer_calls: int = 0  # streaming layer calls
    device_routed: int = 0  # ... of them routed on the device: every expert held, no host sync
    passes: int = 0  # extra passes when a call needed more experts than a layer has slots
    bytes_read: int = 0
    reads: int = 0  # preadv jobs (each a run of adjacent experts of one tensor)
    evictions: int = 0
    lane_loads: int = 0  # misses read into the pass lane (pass_lane.py): never cached
    read_s: float = 0.0  # worker time in preadv, summed
    stall_s: float = 0.0  # engine thread waiting for reads
    router_sync_s: float = (
        0.0  # evaluating the pending graph up to the router (forced by the read-back)
    )
    router_copy_s: float = 0.0  # copying the indices to the host and planning the layer
    expert_compute_s: float = 0.0  # evaluating pending expert outputs at a fence (the rest of
    # the expert compute runs inside the next router read-back: router_sync_s)
    layer_s: float = 0.0  # wall time inside streaming layers (all of the above plus their Python)
    prefetched: int = 0  # experts read speculatively for the next layer
    prefetch_hits: int = 0  # ... that the next layer did use
    prefetch_dropped: int = 0  # ... that it did not: cancelled (or finished) and given back
    prefetch_cancelled_bytes: int = 0  # speculative reads cancelled before they started
    prefetch_bytes: int = 0  # not in bytes_read (demand misses only)
    prompt_end_reads: int = 0  # of `prefetched`: read ahead for a prompt's last token
    prompt_end_hits: int = 0  # ... that the prompt-end step routed to
    warm_bytes: int = 0  # read by warm(), not counted as misses
    warm_s: float = 0.0

    def snapshot(self) -> dict[str, Any]:
        hits = sum(c.all_hits for c in self.layers)
        misses = sum(c.misses for c in self.layers)
        return {
            "hits": hits,
            "misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
            "layer_hit_rates": [
                c.all_hits / (c.all_hits + c.misses) if c.all_hits + c.misses else 0.0
                for c in self.layers
            ],
            "layer_hits": [c.all_hits for c in self.layers],
            "layer_misses": [c.misses for c in self.layers],
            "tokens": self.tokens,
            "steps": self.steps,
            "host_syncs": self.host_syncs,
            "fences": self.fences,
            "overlapped": self.overlapped,
            "layer_calls": self.layer_calls,
            "device_routed": self.device_routed,
            "passes": self.passes,
            "bytes_read": self.bytes_read,
            "reads": self.reads,
            "evictions": self.evictions,
            "lane_loads": self.lane_loads,
            "read_s": self.read_s,
            "stall_s": self.stall_s,
            "router_readback_s": self.router_sync_s + self.router_copy_s,
            "router_sync_s": self.router_sync_s,
            "router_copy_s": self.router_copy_s,
            "expert_compute_s": self.expert_compute_s,
            "layer_s": self.layer_s,
            "layer_python_s": max(
                0.0,
                self.layer_s
                - self.router_sync_s
                - self.router_copy_s
                - self.stall_s
                - self.expert_compute_s,
            ),
            "prefetched": self.prefetched,
            "prefetch_hits": self.prefetch_hits,
            "prefetch_dropped": self.prefetch_dropped,
            "prefetch_cancelled_bytes": self.prefetch_cancelled_bytes,
            "prefetch_bytes": self.prefetch_bytes,
            "prompt_end_reads": self.prompt_end_reads,
            "prompt_end_hits": self.prompt_end_hits,
            "warm_bytes": self.warm_bytes,
            "warm_s": self.warm_s,
        }
