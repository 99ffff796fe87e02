"""The results of `moed bench stream` and their text report."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class RunResult:
    name: str
    slots: int = 0
    tokens: list[int] = field(default_factory=list)
    decode_tokens: int = 0
    decode_s: float = 0.0
    token_s: list[float] = field(default_factory=list)  # wall time of each decode token
    counters: dict = field(default_factory=dict)  # decode-phase deltas of the streamer's counters
    hits_total: int = 0
    misses_total: int = 0
    policy: str = ""
    speculation: dict = field(default_factory=dict)  # the step tuner's switches at the end
    lookahead: dict = field(default_factory=dict)  # lookahead.py's counters (decode phase)
    policy_sim: tuple[int, int] = (0, 0)  # the streamer's policy replayed on its routing trace
    belady: tuple[int, int] = (0, 0)
    expert_bytes: int = 0

    @property
    def tok_s(self) -> float:
        """From the median token time: robust to other processes stealing the CPU for a while."""
        if not self.token_s:
            return self.decode_tokens / self.decode_s if self.decode_s else 0.0
        ordered = sorted(self.token_s)
        return 1.0 / ordered[len(ordered) // 2]


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def paired_speed(run: RunResult, resident: RunResult) -> float:
    """Speed against resident: the median over rounds of resident's token time over this run's
    in the same round (both decoded in it, one after the other), so a slow stretch of the machine
    hits both sides of each ratio."""
    pairs = [a / b for a, b in zip(resident.token_s, run.token_s) if b]
    if not pairs:
        return run.tok_s / resident.tok_s if resident.tok_s else 0.0
    return statistics.median(pairs)


def _raw_line(raw: dict) -> str:
    before, after = raw.get("before_mb_s", raw["mb_s"]), raw.get("after_mb_s", raw["mb_s"])
    mid = raw.get("between_mb_s") or []
    where = (
        f"median of {len(mid)} samples between decode tokens, {min(mid):.0f}-{max(mid):.0f}; "
        if mid
        else "mean of before and after; "
    )
    return (
        f"raw parallel pread, page cache dropped (the better of buffered and O_DIRECT reads): "
        f"{raw['mb_s']:.0f} MB/s ({where}"
        f"{before:.0f} before and {after:.0f} after the runs, "
        f"{raw['bytes'] / 1e6:.0f} MB in {raw['reads']} expert-tensor reads)"
    )


def host_us_per_call(c: dict) -> float:
    """The streaming layers' own host time per layer call (Python, planning, slot tables, graph
    building, index copies), without what they wait for (syncs, reads, fences)."""
    busy = c["layer_s"] - c["router_sync_s"] - c["stall_s"] - c["expert_compute_s"]
    return 1e6 * max(0.0, busy) / max(1, c["layer_calls"])


def bound_tok_s(run: RunResult, resident: RunResult, raw_mb_s: float) -> float:
    """The physical bound of a streaming run: one token per max(its bytes read at the raw read
    bandwidth, resident compute time)."""
    per_tok = run.counters["bytes_read"] / max(1, run.decode_tokens)
    read_s = per_tok / (raw_mb_s * 1e6) if raw_mb_s else 0.0
    compute_s = 1.0 / resident.tok_s if resident.tok_s else 0.0
    return 1.0 / max(read_s, compute_s) if max(read_s, compute_s) else 0.0


def floor_tok_s(run: RunResult, host_routed: RunResult | None, raw_mb_s: float) -> float:
    """The serial floor of a streaming run: one token per (the host-routed preloaded run's token
    time + its bytes read at the raw read bandwidth), what a decoder reaches that reads a layer's
    misses only once its router is known (no read overlaps compute) at zero read overhead."""
    if host_routed is None or not host_routed.tok_s or not raw_mb_s:
        return 0.0
    per_tok = run.counters["bytes_read"] / max(1, run.decode_tokens)
    return 1.0 / (1.0 / host_routed.tok_s + per_tok / (raw_mb_s * 1e6))


def gpu_report(raw: dict, resident: RunResult, runs: list[RunResult]) -> list[str]:
    """Per budget, what a GPU (or Metal) exposes and a CPU hides: host syncs, host time between
    kernels and read stalls, against resident, the physical bound and the serial floor."""
    host_routed = next((r for r in runs if r.name.endswith("+pre,host")), None)
    lines = [
        "",
        "per budget (host syncs drain a GPU's queue; host time leaves it idle):",
        f"{'budget':>8} {'tok/s':>7} {'x res':>6} {'syncs/tok':>9} {'on device':>9} "
        f"{'host us/call':>12} {'stall ms/tok':>12} {'bound tok/s':>11} {'x bound':>7}"
        + (f" {'floor tok/s':>11} {'floor x bound':>13}" if host_routed else ""),
        f"{'resident':>8} {resident.tok_s:7.2f} {1.0:6.2f}",
    ]
    for r in runs:
        c, n = r.counters, max(1, r.decode_tokens)
        bound = bound_tok_s(r, resident, raw["mb_s"])
        line = (
            f"{r.name:>8} {r.tok_s:7.2f} {paired_speed(r, resident):6.2f} "
            f"{c['host_syncs'] / n:9.2f} "
            f"{100 * c.get('device_routed', 0) / max(1, c['layer_calls']):8.0f}% "
            f"{host_us_per_call(c):12.0f} {1e3 * c['stall_s'] / n:12.2f} "
            f"{bound:11.2f} {_ratio(r.tok_s, bound):>7}"
        )
        if host_routed is not None and c["bytes_read"]:
            floor = floor_tok_s(r, host_routed, raw["mb_s"])
            line += f" {floor:11.2f} {_ratio(floor, bound):>13}"
        lines.append(line)
    lines.append(
        "on device: layer calls routed on the device (every expert held: no read-back). bound: one "
        "token per max(bytes read at the raw bandwidth, resident token time)."
    )
    if host_routed is not None:
        lines.append(
            "floor: one token per (100%+pre,host's token time + bytes read at the raw bandwidth): "
            "every layer read back, its misses read only once its router is known, at raw "
            "bandwidth with no overhead (no read overlapping compute)."
        )
    return lines


def report(meta: dict, raw: dict, resident: RunResult, runs: list[RunResult]) -> str:
    lines = [
        f"moed bench stream: {meta['layers']} MoE layers x {meta['experts']} experts "
        f"(top-{meta['top_k']}), hidden {meta['hidden']}, "
        f"expert width {meta['width']}, {meta['bits']}-bit {meta['dtype']}; "
        f"one expert {meta['expert_bytes'] / 1e6:.2f} MB, "
        f"experts {meta['experts_bytes'] / 1e9:.2f} GB",
        f"decode {meta['tokens']} tokens after a {meta['warmup']}-token warm-up; "
        f"{raw['workers']} read workers; page cache: {meta['page_cache']}; "
        f"landing: {meta.get('landing', 'direct')}",
        _raw_line(raw),
        "",
        f"{'budget':>8} {'slots':>5} {'tok/s':>7} {'x res':>6} {'same':>5} "
        f"{'hit%':>6} {'belady%':>8} {'hit/opt':>7} "
        f"{'MB/tok':>7} {'B/(miss*E)':>10} {'read MB/s':>9} {'x raw':>6} {'syncs/tok':>9}",
        f"{'resident':>8} {'-':>5} {resident.tok_s:7.2f} {1.0:6.2f} {'-':>5}",
    ]
    for r in runs:
        c = r.counters
        hr = (
            r.hits_total / (r.hits_total + r.misses_total) if r.hits_total + r.misses_total else 0.0
        )
        bh, bm = r.belady
        opt = bh / (bh + bm) if bh + bm else 0.0
        if r.belady == (0, 0):  # preloaded or speculative: no offline optimum to compare with
            opt = 0.0
        mb_tok = c["bytes_read"] / r.decode_tokens / 1e6 if r.decode_tokens else 0.0
        exact = c["bytes_read"] / (c["misses"] * r.expert_bytes) if c["misses"] else 0.0
        moved = c["bytes_read"] + c.get("prefetch_bytes", 0)
        bw = moved / c["stall_s"] / 1e6 if c["stall_s"] and moved > 16 * r.expert_bytes else 0.0
        lines.append(
            f"{r.name:>8} {r.slots:5d} {r.tok_s:7.2f} {paired_speed(r, resident):6.2f} "
            f"{'yes' if r.tokens == resident.tokens else 'NO':>5} "
            f"{100 * hr:6.1f} {(f'{100 * opt:.1f}' if opt else '-'):>8} "
            f"{(_ratio(hr, opt) if opt else '-'):>7} {mb_tok:7.1f} "
            f"{(f'{exact:.3f}' if exact else '-'):>10} "
            f"{(f'{bw:.0f}' if bw else '-'):>9} {(_ratio(bw, raw['mb_s']) if bw else '-'):>6} "
            f"{c['host_syncs'] / max(1, r.decode_tokens):9.2f}"
        )
    for r in runs:
        c = r.counters
        if c.get("prefetched"):
            lines.append(
                f"{r.name}: {c['prefetched']} experts read ahead (next layer, prompt ends), "
                f"{100 * c['prefetch_hits'] / c['prefetched']:.0f}% "
                "of them used; with prefetch "
                f"{(c['bytes_read'] + c['prefetch_bytes']) / max(1, r.decode_tokens) / 1e6:.1f}"
                " MB/token read"
            )

    for r in runs:
        g = r.speculation
        if g.get("prefetch_net_ms_per_step") is not None:
            lines.append(
                f"{r.name}: next-layer prefetch used {100 * (g['prefetch_accuracy'] or 0):.0f}% "
                f"of its guesses, saved {g['prefetch_net_ms_per_step']:+.2f} ms per step in the "
                f"tuner's last probe; {'on' if g['prefetch_next_active'] else 'off'} at the end"
            )
    overlap = [
        f"{r.name} {r.speculation['overlap_net_ms_per_step']:+.2f}"
        + ("" if r.speculation["overlap_reads_active"] else " (off)")
        for r in runs
        if r.speculation.get("overlap_net_ms_per_step") is not None
    ]
    if overlap:
        lines.append(
            "computing resident experts during reads, ms per step saved in the last probe: "
            + ", ".join(overlap)
        )
    simulated = [r for r in runs if r.policy_sim != (0, 0)]
    sim_ok = all(r.policy_sim == (r.hits_total, r.misses_total) for r in simulated)
    lines.append(
        f"(a simulation of {', '.join(sorted({r.policy for r in simulated}))} on the same trace "
        f"{'reproduces' if sim_ok else 'DOES NOT reproduce'} the streamer's hits and misses)"
    )
    lines += [
        "",
        "time per decode token (ms):",
        f"{'budget':>8} {'wall':>7} {'sync':>11} {'fences':>8} {'readback':>8} "
        f"{'stall':>7} {'reads*':>7} "
        f"{'moe py':>7} {'other':>7}",
    ]
    lines.append(f"{'resident':>8} {1e3 * resident.decode_s / max(1, resident.decode_tokens):7.2f}")
    for r in runs:
        c, n = r.counters, max(1, r.decode_tokens)
        wall = r.decode_s / n
        sync, copy = c["router_sync_s"] / n, c["router_copy_s"] / n
        comp, stall, reads = c["expert_compute_s"] / n, c["stall_s"] / n, c["read_s"] / n
        moe_py = c["layer_python_s"] / n
        other = wall - c["layer_s"] / n
        lines.append(
            f"{r.name:>8} {1e3 * wall:7.2f} {1e3 * sync:11.2f} {1e3 * comp:8.2f} "
            f"{1e3 * copy:8.2f} {1e3 * stall:7.2f} "
            f"{1e3 * reads:7.2f} {1e3 * moe_py:7.2f} {1e3 * other:7.2f}"
        )
    lines += gpu_report(raw, resident, runs)
    lines += [
        "",
        "100%+pre: every expert preloaded before the warm-up (no cold misses): "
        "the streaming machinery's own cost; 100%+pre,host: the same with every layer still "
        "read back to the host.",
        "+spec: speculative next-layer prefetch (hits include prefetched experts; "
        "read MB/s: demand + prefetch",
        "bytes over the time stalled, so reads hidden behind compute push it above "
        "the raw bandwidth).",
        "same: greedy tokens identical to resident. hit%: all calls (warm-up + decode); "
        "belady%: offline optimum",
        "on the same routing trace and slots. B/(miss*E): decode bytes read / "
        "(misses x expert bytes).",
        "read MB/s: decode bytes read / time stalled on reads. syncs/tok: evaluations the "
        "streaming layers forced",
        "per decode token (router read-backs + fences). sync: the router read-backs, which "
        "evaluate everything pending",
        "(attention, router, the previous layer's experts); fences: evaluating pending outputs "
        "before a slot they read is",
        "reused; readback: copying indices to the host; reads*: worker time summed",
        "over parallel reads (inside the stall); moe py: the streaming layers' own Python "
        "(planning, slot tables,",
        "graph building); other: outside the streaming layers "
        "(generate_step, sampling, graph building).",
        "All models are loaded at once and decode interleaved token by token "
        "(same machine conditions);",
        "tok/s uses the median token time; x res: the median over rounds of resident's token",
        "time over the row's in the same round (the order rotates by round); the breakdown uses",
        "means.",
    ]
    return "\n".join(lines)
