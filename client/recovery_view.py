"""How `moe status` and `moe ps` show the daemon's recoveries in place from a device failure: the
last one's kind, phase and what it shed, the counts by kind, or why the daemon restarts instead."""

from __future__ import annotations

from typing import Any

from moed.protocol.units import format_bytes


def shed_text(shed: dict[str, Any]) -> str:
    """What a recovery gave up, in the order it gives things up."""
    parts = []
    if prefix := shed.get("prefix_cache_memory"):
        parts.append(f"prefix cache {format_bytes(prefix.get('released_bytes'))}")
    if budget := shed.get("expert_budget"):
        parts.append(
            f"expert budget {format_bytes(budget.get('from_bytes'))} -> "
            f"{format_bytes(budget.get('to_bytes'))}"
        )
    if chunk := shed.get("prompt_chunk"):
        parts.append(f"prompt chunk {chunk.get('from_tokens')} -> {chunk.get('to_tokens')} tokens")
    return ", ".join(parts) or "nothing"


def last_recovery_text(last: dict[str, Any] | None) -> str:
    """`recovering from out_of_memory (shed ...)`, `recovered from gpu_timeout in 0.4 s (...)`."""
    if not last:
        return "-"
    took = last.get("took_s")
    when = f" in {took:.2f} s" if last.get("phase") == "recovered" and took is not None else ""
    shed = shed_text(last.get("shed") or {})
    return f"{last.get('phase')} from {last.get('kind')}{when} (shed {shed})"


def recovery_line(status: dict[str, Any]) -> str | None:
    """One line for `moe status`, or None when there is nothing to say (in place, none yet)."""
    mode = status.get("device_recovery")
    last = status.get("last_recovery")
    counts = status.get("recoveries") or {}
    if not last and mode in (None, "in_place"):
        return None
    counted = ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items()))
    text = f"{mode}" + (f"; {counted}" if counted else "")
    if last:
        text += f"; last {last_recovery_text(last)}"
    return text
