"""Prometheus text exposition (format 0.0.4) of the `stats` body, rendered by hand: no dependency.

Names follow Prometheus conventions: `moed_` prefix, base units (bytes, seconds), `_total` on
counters. Missing values (null in `stats`) are left out rather than reported as zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_PRESSURE = {"normal": 0, "warn": 1, "critical": 2}


@dataclass
class Family:
    name: str
    kind: str  # counter | gauge
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)

    def add(self, value, **labels: str) -> None:
        if value is None:
            return
        self.samples.append((labels, float(value)))


def _escape_label(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def _render(families: list[Family]) -> str:
    lines: list[str] = []
    for fam in families:
        if not fam.samples:
            continue
        name = fam.name + ("_total" if fam.kind == "counter" else "")
        lines.append(f"# HELP {name} {fam.help}")
        lines.append(f"# TYPE {name} {fam.kind}")
        for labels, value in fam.samples:
            label_text = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items())
            lines.append(
                f"{name}{{{label_text}}} {_fmt(value)}" if label_text else f"{name} {_fmt(value)}"
            )
    return "\n".join(lines) + "\n"


def _families(stats: dict) -> list[Family]:
    fams: dict[str, Family] = {}

    def fam(name: str, kind: str, help: str) -> Family:
        if name not in fams:  # one family, a sample per model
            fams[name] = Family(f"moed_{name}", kind, help)
        return fams[name]

    model = stats.get("model") or {}
    fam("info", "gauge", "Daemon build and model (value is always 1).").add(
        1,
        version=str(stats.get("version") or ""),
        model=str(model.get("name") or ""),
        model_type=str(model.get("model_type") or ""),
        boot_id=str(stats.get("boot_id") or ""),
        mode="streaming" if model.get("streaming") else "resident",
    )
    fam("state", "gauge", "1 for the daemon's current state.").add(1, state=str(stats.get("state")))
    fam("uptime_seconds", "gauge", "Seconds since the daemon started.").add(stats.get("uptime_s"))

    mem = stats.get("memory") or {}
    fam("process_resident_bytes", "gauge", "Resident set size of the daemon.").add(
        mem.get("rss_bytes")
    )
    fam("process_phys_footprint_bytes", "gauge", "macOS phys_footprint of the daemon.").add(
        mem.get("phys_footprint_bytes")
    )
    fam("process_swap_bytes", "gauge", "Swapped-out memory of the daemon (Linux).").add(
        mem.get("process_swap_bytes")
    )
    fam("swap_used_bytes", "gauge", "Swap in use, system-wide.").add(mem.get("swap_used_bytes"))
    fam(
        "memory_pressure_level", "gauge", "Kernel memory pressure: 0 normal, 1 warn, 2 critical."
    ).add(_PRESSURE.get(str(mem.get("pressure"))))
    fam("crash_restarts", "gauge", "Restarts after a crash within the restart window.").add(
        stats.get("restarts")
    )
    fam("last_crash_timestamp_seconds", "gauge", "When the last recorded crash happened.").add(
        (stats.get("last_crash") or {}).get("at")
        if isinstance(stats.get("last_crash"), dict)
        else None
    )
    _recovery_families(stats, fam)

    models = stats.get("models")
    if models is None:  # a body without per-model figures: its own, unlabelled
        _engine_families(stats, fam, {})
    loaded = fam("model_loaded", "gauge", "1 while the model is loaded (or loading), else 0.")
    for m in models or []:
        loaded.add(1 if m.get("loaded") else 0, model=str(m.get("name")))
        _engine_families(m, fam, {"model": str(m.get("name"))})
    return list(fams.values())


def _engine_families(stats: dict, fam, label: dict[str, str]) -> None:
    """One engine's requests, tokens, expert cache and prefix cache, each sample under `label`
    (`model` in a body with several models)."""
    req = stats.get("requests") or {}
    fam("requests_served", "counter", "Generations that finished with done.").add(
        req.get("served"), **label
    )
    fam("requests_failed", "counter", "Generations that ended with an error.").add(
        req.get("failed"), **label
    )
    fam("requests_active", "gauge", "Generations being decoded.").add(req.get("active"), **label)
    fam("requests_pending", "gauge", "Generations admitted and not yet finished.").add(
        req.get("pending"), **label
    )

    tok = stats.get("tokens") or {}
    fam("tokens_generated", "counter", "Tokens generated for clients.").add(
        tok.get("generated"), **label
    )
    fam("tokens_per_second", "gauge", "Tokens generated per second over the recent window.").add(
        tok.get("per_s"), **label
    )

    ex = stats.get("experts")
    if ex:
        fam("expert_cache_budget_bytes", "gauge", "Expert cache budget.").add(
            ex.get("budget_bytes"), **label
        )
        fam("expert_cache_resident_bytes", "gauge", "Bytes of expert slots allocated.").add(
            ex.get("resident_bytes"), **label
        )
        fam("expert_pass_lane_bytes", "gauge", "Bytes of the pass lane beside the slots.").add(
            ex.get("lane_bytes"), **label
        )
        fam("expert_cache_experts", "gauge", "Experts resident in the cache.").add(
            ex.get("cached_experts"), **label
        )
        fam("expert_hits", "counter", "Expert lookups served from the cache.").add(
            ex.get("hits"), **label
        )
        fam("expert_misses", "counter", "Expert lookups that needed a read.").add(
            ex.get("misses"), **label
        )
        fam("expert_hit_ratio", "gauge", "Hit rate since start.").add(ex.get("hit_rate"), **label)
        layer_hits = fam("expert_layer_hits", "counter", "Expert cache hits per MoE layer.")
        layer_misses = fam("expert_layer_misses", "counter", "Expert cache misses per MoE layer.")
        for i, (h, m) in enumerate(zip(ex.get("layer_hits") or [], ex.get("layer_misses") or [])):
            layer_hits.add(h, **label, layer=str(i))
            layer_misses.add(m, **label, layer=str(i))
        fam(
            "expert_routed_tokens", "counter", "Token rows routed through the first MoE layer."
        ).add(ex.get("tokens"), **label)
        fam("expert_read_bytes", "counter", "Expert bytes read from disk on misses.").add(
            ex.get("bytes_read"), **label
        )
        fam("expert_warm_bytes", "counter", "Expert bytes read to warm the cache.").add(
            ex.get("warm_bytes"), **label
        )
        fam(
            "expert_speculative_read_bytes",
            "counter",
            "Expert bytes read ahead of their call (next-layer guesses, a prompt's end).",
        ).add(ex.get("prefetch_bytes"), **label)
        fam(
            "expert_prompt_end_reads",
            "counter",
            "Experts read ahead for the step reading a prompt's last token.",
        ).add(ex.get("prompt_end_reads"), **label)
        fam(
            "expert_prompt_end_hits",
            "counter",
            "Of them, experts that step routed to.",
        ).add(ex.get("prompt_end_hits"), **label)
        fam("expert_reads", "counter", "preadv jobs run by the read workers.").add(
            ex.get("reads"), **label
        )
        fam("expert_evictions", "counter", "Experts evicted from the cache.").add(
            ex.get("evictions"), **label
        )
        fam("expert_read_seconds", "counter", "Worker time in preadv, summed.").add(
            ex.get("read_s"), **label
        )
        fam("expert_stall_seconds", "counter", "Engine time waiting for expert reads.").add(
            ex.get("stall_s"), **label
        )
        fam(
            "router_readback_seconds",
            "counter",
            "Engine time reading router choices back to the host.",
        ).add(ex.get("router_readback_s"), **label)
        fam("expert_compute_seconds", "counter", "Engine time evaluating expert outputs.").add(
            ex.get("expert_compute_s"), **label
        )
        fam(
            "expert_extra_passes",
            "counter",
            "Extra passes when a call needed more experts than slots.",
        ).add(ex.get("passes"), **label)
        fam(
            "expert_read_bytes_per_second", "gauge", "Expert read rate over the recent window."
        ).add(ex.get("recent_bytes_read_per_s"), **label)
    _prefix_cache_families(stats.get("prefix_cache"), fam, label)


def _recovery_families(stats: dict, fam) -> None:
    """Device failures recovered in place (engine/recovery.py): counted by kind; the last one's
    time and what it shed."""
    recoveries = fam("device_recoveries", "counter", "Device failures recovered in place, by kind.")
    for kind, n in sorted((stats.get("recoveries") or {}).items()):
        recoveries.add(n, kind=str(kind))
    last = stats.get("last_recovery")
    if not isinstance(last, dict):
        return
    fam("last_recovery_timestamp_seconds", "gauge", "When the last recovery in place began.").add(
        last.get("at"), kind=str(last.get("kind")), phase=str(last.get("phase"))
    )
    shed = last.get("shed") or {}
    released = fam("last_recovery_shed_bytes", "gauge", "Memory the last recovery gave up.")
    released.add((shed.get("prefix_cache_memory") or {}).get("released_bytes"), what="prefix_cache")
    budget = shed.get("expert_budget") or {}
    if budget:
        released.add(budget.get("from_bytes", 0) - budget.get("to_bytes", 0), what="expert_budget")
    fam("prompt_chunk_limit_tokens", "gauge", "The prompt chunk's ceiling a recovery set.").add(
        stats.get("prompt_chunk_limit")
    )


def _prefix_cache_families(pc: dict | None, fam, label: dict[str, str]) -> None:
    if not pc:
        return
    fam("prefix_cache_lookups", "counter", "Requests that asked the prefix cache.").add(
        pc.get("lookups"), **label
    )
    fam("prefix_cache_hits", "counter", "Requests that resumed from a cached prefix.").add(
        pc.get("hits"), **label
    )
    fam("prefix_cache_tokens_reused", "counter", "Prompt tokens not read again: cached.").add(
        pc.get("tokens_reused"), **label
    )
    per_tier = {
        "bytes": fam("prefix_cache_bytes", "gauge", "Bytes held by the prefix cache, per tier."),
        "budget_bytes": fam("prefix_cache_budget_bytes", "gauge", "Its budget, per tier."),
        "entries": fam("prefix_cache_entries", "gauge", "Cached prefixes, per tier."),
        "evictions": fam("prefix_cache_evictions", "counter", "Entries evicted, per tier."),
    }
    for tier in ("memory", "disk"):
        for key, family in per_tier.items():
            family.add(pc.get(f"{tier}_{key}"), **label, tier=tier)
    fam("prefix_cache_disk_loads", "counter", "Entries read back from the SSD tier.").add(
        pc.get("disk_loads"), **label
    )
    fam("prefix_cache_disk_skipped", "counter", "SSD entries skipped: corrupt or foreign.").add(
        pc.get("disk_skipped"), **label
    )
    refused = fam(
        "prefix_cache_disk_rejected", "counter", "SSD entry files refused, by why (not foreign)."
    )
    for reason, count in sorted((pc.get("disk_rejected") or {}).items()):
        refused.add(count, **label, reason=reason)


def render_metrics(stats: dict) -> str:
    """Prometheus text exposition of a `stats` body."""
    return _render(_families(stats))
