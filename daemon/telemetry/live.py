"""The `stats` body: the daemon's live state in one map, derived from its status and counters.

Counters are cumulative (since the daemon started); a sampler keeps a few seconds of history so
rates (tokens/s, read bandwidth, recent hit rate) describe what the daemon is doing now.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from moed.daemon.platform import probe_for_platform
from moed.daemon.telemetry.metrics import render_metrics
from moed.daemon.telemetry.per_model import ModelFigures, SampleValues, model_stats, sample_values

log = logging.getLogger("moed.telemetry")

RATE_WINDOW_S = 5.0  # rates cover about this much recent history
SAMPLE_EVERY_S = 0.25
DAEMON = ""  # the sampler's key of the body's own figures (the started model's engine)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _per_token_ms(seconds: float, tokens: int) -> float | None:
    return seconds * 1000.0 / tokens if tokens else None


def expert_stats(snap: dict | None) -> dict | None:
    """Derived expert-cache numbers from an `ExpertStreamer.snapshot()` (None when resident)."""
    if not snap:
        return None
    hits, misses, tokens = snap.get("hits", 0), snap.get("misses", 0), snap.get("tokens", 0)
    layer_misses = list(snap.get("layer_misses") or [])
    layer_hits = snap.get("layer_hits")
    if layer_hits is None:  # older snapshot: rebuild hits from the per-layer rate and misses
        rates = snap.get("layer_hit_rates") or []
        layer_hits = [round(r * m / (1 - r)) if r < 1 else 0 for r, m in zip(rates, layer_misses)]
    return {
        "budget_bytes": snap.get("budget_bytes"),
        "resident_bytes": snap.get("resident_bytes"),
        "experts_bytes": snap.get("experts_bytes"),
        "expert_bytes": snap.get("expert_bytes"),
        "num_layers": snap.get("num_layers"),
        "num_experts": snap.get("num_experts"),
        "slots_per_layer": snap.get("slots_per_layer"),
        "cached_experts": snap.get("cached_experts"),
        "page_cache_bypass": snap.get("page_cache_bypass"),
        "direct_io": snap.get("direct_io"),
        "prefetch_workers": snap.get("prefetch_workers"),
        "hits": hits,
        "misses": misses,
        "hit_rate": _ratio(hits, hits + misses),
        "layer_hits": list(layer_hits),
        "layer_misses": layer_misses,
        "layer_hit_rates": list(snap.get("layer_hit_rates") or []),
        "tokens": tokens,  # token rows routed (prompt and generated)
        "bytes_read": snap.get("bytes_read", 0),
        "bytes_read_per_token": _ratio(snap.get("bytes_read", 0), tokens),
        # What the engine thread saw: bytes over the time it waited for them.
        # Stalls include waiting for speculative (prefetch) reads, so their bytes count here too.
        "read_bandwidth_bps": _ratio(
            snap.get("bytes_read", 0) + snap.get("prefetch_bytes", 0), snap.get("stall_s", 0.0)
        ),
        "stall_s": snap.get("stall_s", 0.0),
        "stall_ms_per_token": _per_token_ms(snap.get("stall_s", 0.0), tokens),
        "router_readback_s": snap.get("router_readback_s", 0.0),
        "router_readback_ms_per_token": _per_token_ms(snap.get("router_readback_s", 0.0), tokens),
        "expert_compute_s": snap.get("expert_compute_s", 0.0),
        # Evaluations the streaming layers forced per forward step (one decode token): the
        # router read-backs plus the fences before a pending read's slot was reused.
        "host_syncs": snap.get("host_syncs", 0),
        "host_syncs_per_step": _ratio(snap.get("host_syncs", 0), snap.get("steps", 0)),
        # --prefetch-next: whether the step tuner has it on, the share of its guesses used and
        # the step time it saved (negative: cost) in its last probe; the same for computing
        # resident experts while the misses are read.
        "prefetch_next_active": snap.get("prefetch_next_active", False),
        "prefetch_accuracy": snap.get("prefetch_accuracy"),
        "prefetch_net_ms_per_step": snap.get("prefetch_net_ms_per_step"),
        "overlap_reads_active": snap.get("overlap_reads_active", False),
        "overlap_net_ms_per_step": snap.get("overlap_net_ms_per_step"),
        "read_s": snap.get("read_s", 0.0),
        "reads": snap.get("reads", snap.get("read_jobs", 0)),
        "evictions": snap.get("evictions", 0),
        "passes": snap.get("passes", 0),
        "warm_bytes": snap.get("warm_bytes", 0),
        # Read ahead of their call (next-layer guesses, prompt ends); not in bytes_read.
        "prefetch_bytes": snap.get("prefetch_bytes", 0),
        # The step reading a prompt's last token (experts/prompt_end.py): experts read ahead for
        # it, those it used, and how much prompt ends repeat each other (None: not known yet).
        "prompt_end_reads": snap.get("prompt_end_reads", 0),
        "prompt_end_hits": snap.get("prompt_end_hits", 0),
        "prompt_end_shared": snap.get("prompt_end_shared"),
    }


class _Sampler:
    """Keeps (time, {engine: (tokens, bytes read, hits, misses)}) samples covering the last
    RATE_WINDOW_S; an engine's rates come from the samples that saw it."""

    def __init__(self, read: Callable[[], dict[str, SampleValues]]):
        self._read = read
        self._samples: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="moed-telemetry", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def sample(self) -> None:
        try:
            values = self._read()
        except Exception:  # a sample is advisory; never let it kill the thread
            log.debug("telemetry sample failed", exc_info=True)
            return
        now = time.monotonic()
        with self._lock:
            self._samples.append((now, values))
            while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_WINDOW_S:
                self._samples.popleft()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY_S):
            self.sample()

    def rates(self, key: str = DAEMON) -> dict:
        """The engine's rates over the window (call sample() first for an up-to-date end)."""
        with self._lock:
            seen = [(t, values[key]) for t, values in self._samples if key in values]
        if len(seen) < 2:
            return {
                "window_s": 0.0,
                "tokens_per_s": None,
                "bytes_read_per_s": None,
                "hit_rate": None,
            }
        (t0, first), (t1, last) = seen[0], seen[-1]
        dt = t1 - t0
        d_tokens, d_bytes, d_hits, d_misses = (b - a for a, b in zip(first, last))
        return {
            "window_s": dt,
            "tokens_per_s": d_tokens / dt if dt > 0 else None,
            "bytes_read_per_s": d_bytes / dt if dt > 0 else None,
            "hit_rate": _ratio(d_hits, d_hits + d_misses),
        }


def _probe():
    try:
        return probe_for_platform()
    except RuntimeError:  # no probe for this platform: memory fields read as null
        return None


def memory_stats(pid: int, rss_bytes: int | None, probe) -> dict:
    out: dict[str, Any] = {
        "rss_bytes": rss_bytes,
        "phys_footprint_bytes": None,
        "process_swap_bytes": None,
        "swap_used_bytes": None,
        "pressure": "unknown",
    }
    if probe is None:
        return out
    try:
        fp = probe.process_footprint(pid)
        if fp is not None:
            out["rss_bytes"] = fp.resident_bytes
            out["phys_footprint_bytes"] = fp.phys_footprint_bytes
            out["process_swap_bytes"] = fp.swap_bytes
        out["swap_used_bytes"] = probe.swap_used_bytes()
        out["pressure"] = probe.pressure_level().value
    except Exception:
        log.debug("memory probe failed", exc_info=True)
    return out


def build_stats(
    status: dict, streamer_snapshot: dict | None, rates: dict | None = None, probe=None
) -> dict:
    """The `stats` body from a status snapshot (Server.status_body) and a streamer snapshot."""
    model = status.get("model") or {}
    rates = rates or {}
    experts = expert_stats(streamer_snapshot)
    if experts is not None:
        experts["recent_hit_rate"] = rates.get("hit_rate")
        experts["recent_bytes_read_per_s"] = rates.get("bytes_read_per_s")
    crash = status.get("last_crash")
    return {
        "state": status.get("state"),
        "pid": status.get("pid"),
        "boot_id": status.get("boot_id"),
        "version": status.get("version"),
        "uptime_s": status.get("uptime_s"),
        "model": {
            "name": model.get("name"),
            "path": model.get("path"),
            "model_type": model.get("model_type"),
            "streaming": bool(model.get("streaming")),
        },
        "requests": {
            "served": status.get("requests_served", 0),
            "failed": status.get("requests_failed", 0),
            "active": status.get("active_requests", 0),
            "pending": status.get("pending_requests", 0),
            "queued": status.get("queued_requests", 0),
        },
        "tokens": {
            "generated": status.get("tokens_generated", 0),
            "per_s": rates.get("tokens_per_s"),
            "window_s": rates.get("window_s"),
        },
        "experts": experts,
        "prefix_cache": status.get("prefix_cache"),
        "memory": memory_stats(status.get("pid") or 0, status.get("rss_bytes"), probe),
        "restarts": status.get(
            "restarts", status.get("recent_crashes")
        ),  # crash restarts in the restart window
        "last_crash": crash if crash else None,
        # Device failures recovered in place, by kind, and the last one (engine/recovery.py).
        "recoveries": status.get("recoveries") or {},
        "last_recovery": status.get("last_recovery"),
        "prompt_chunk_limit": status.get("prompt_chunk_limit"),
        "time": time.time(),
    }


class LiveTelemetry:
    """The transport thread's view: `stats()` and `metrics_text()` for one running daemon.

    `status_body` gives the status map; `streamer` returns the ExpertStreamer or None; `models`
    every served model's figures (the body's `models`). Counters are read from the transport
    (or HTTP) thread: plain ints the engine thread only adds to.
    """

    def __init__(
        self,
        status_body: Callable[[], dict],
        streamer: Callable[[], Any],
        tokens: Callable[[], int],
        models: Callable[[], list[ModelFigures]] = list,
    ):
        self._status_body = status_body
        self._streamer = streamer
        self._tokens = tokens
        self._models = models
        self._probe = _probe()
        self._sampler = _Sampler(self._sample_values)
        self._sampler.start()

    def _sample_values(self) -> dict[str, SampleValues]:
        values = {DAEMON: sample_values(int(self._tokens() or 0), self._streamer())}
        for fig in self._models():
            values[fig.name] = sample_values(
                int(fig.status.get("tokens_generated") or 0), fig.streamer
            )
        return values

    def stats(self) -> dict:
        self._sampler.sample()
        body = build_stats(
            self._status_body(),
            _snapshot(self._streamer()),
            self._sampler.rates(),
            self._probe,
        )
        body["models"] = [
            model_stats(fig, expert_stats(_snapshot(fig.streamer)), self._sampler.rates(fig.name))
            for fig in self._models()
        ]
        return body

    def metrics_text(self) -> str:
        return render_metrics(self.stats())

    def close(self) -> None:
        self._sampler.stop()


def _snapshot(streamer: Any) -> dict | None:
    if streamer is None:
        return None
    try:
        return streamer.snapshot()
    except Exception:  # racing a shed's pool swap: report without expert numbers this time
        log.debug("streamer snapshot failed", exc_info=True)
        return None
