"""`moed trace analyze`: what a router trace says about the expert cache.

Per MoE layer: distinct experts used, popularity (how concentrated the routing is), token-to-token
reuse; and the expert-cache hit rate against cache size for every registered eviction policy
(experts/policies) and for Belady's offline optimum (MIN: evict the expert needed furthest in the
future). The
simulations replay what the daemon does per layer call: the call's distinct experts are admitted
together (more than fit run in passes of `slots`, resident experts first), hits counted per distinct
expert, as the daemon's own counters count them. Where the daemon had a pass lane
(experts/pass_lane.py), a multi-pass call's odd passes are read into the lane: misses that are not
cached; the replay of a recorded run and `moed bench stream` model it, the size curves do not
(they compare the policies' caching alone).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from moed.daemon.experts.policies import DEFAULT_POLICY, POLICIES, EvictionPolicy, make_policy
from moed.daemon.experts.slots import SlotTable
from moed.daemon.telemetry.trace import CLASSES, Trace
from moed.protocol.units import format_bytes

Calls = list[np.ndarray]  # per layer call: the distinct experts, ascending
BELADY = "belady"  # the offline optimum's column


# ---- cache simulation -------------------------------------------------------------------------


def simulate(
    calls: Calls,
    slots: int,
    policy: EvictionPolicy,
    initial: Iterable[int] = (),
    lane: bool = False,
    counted: Sequence[bool] = (),
) -> tuple[int, int]:
    """(hits, misses) of one layer's calls through a `slots`-slot cache run by `policy`: the
    daemon's own slot table (experts/slots.py), pass planning and admission, minus the bytes.
    `lane`: the layer's multi-pass calls alternate with the pass lane (streamer.load_passes).
    `counted[t]` False: call t runs (it fills the cache) but is not counted (a prompt before the
    decode tokens whose hit rate is asked); empty: every call counts."""
    num_experts = 1 + max([int(c.max()) for c in calls if c.size] + [int(e) for e in initial] + [0])
    table = SlotTable(num_experts, slots, policy)
    table.admit(list(initial)[:slots])
    hits = misses = 0
    for t, needed in enumerate(calls):
        count = not counted or counted[t]
        for i, chunk in enumerate(table.plan_passes(needed)):
            if lane and i % 2:  # read into the lane, which caches nothing
                misses += len(chunk) if count else 0
                continue
            h, loads = table.admit(chunk)
            if count:
                hits += len(h)
                misses += len(loads)
    return hits, misses


class BeladyPolicy(EvictionPolicy):
    """Belady's MIN, for the simulator only (it knows the future): evict the resident expert whose
    next use is furthest away. The offline optimum for this cache: no policy does better."""

    name = "belady"

    def __init__(self, calls: Calls, num_experts: int = 0, slots: int = 0):
        super().__init__(num_experts, slots)
        never = math.inf
        # next_use[t][e]: the next call after t that uses e
        self._next_use: list[dict[int, float]] = [dict() for _ in calls]
        upcoming: dict[int, float] = {}
        for t in range(len(calls) - 1, -1, -1):
            for e in calls[t].tolist():
                self._next_use[t][e] = upcoming.get(e, never)
            for e in calls[t].tolist():
                upcoming[e] = t
        self._t = -1
        self._resident: dict[int, float] = {}  # expert -> its next use

    def begin_call(self) -> None:
        self._t += 1

    def insert(self, expert: int) -> None:
        self._resident[expert] = self._next_use[self._t].get(expert, math.inf)

    touch = insert

    def remove(self, expert: int) -> None:
        self._resident.pop(expert, None)

    def victim(self, protected) -> int:
        return max(
            (r for r in self._resident if r not in protected), key=self._resident.__getitem__
        )

    def order(self) -> list[int]:
        return sorted(self._resident, key=lambda e: -self._resident[e])


def simulate_belady(calls: Calls, slots: int) -> tuple[int, int]:
    """(hits, misses) with Belady's MIN through the same slot table as `simulate`."""
    return simulate(calls, slots, BeladyPolicy(calls))


def simulate_layers(
    trace: list[list[set[int]]], slots: int, policy: str, lane: Sequence[bool] = ()
) -> tuple[int, int]:
    """(hits, misses) of one layer-by-layer trace [call][layer] -> experts, counted as the
    streamer counts them (each distinct expert of a call once), for a registered policy (with
    its default parameters) or "belady"; `lane[layer]`: that layer's passes use the pass lane.
    The simulators are `moed trace analyze`'s, so both commands judge a cache the same way."""
    hits = misses = 0
    layers = len(trace[0]) if trace else 0
    for layer in range(layers):
        calls = [np.array(sorted(call[layer]), dtype=np.int64) for call in trace]
        experts = 1 + max((max(c) for call in trace for c in call if c), default=0)
        chosen = BeladyPolicy(calls) if policy == BELADY else make_policy(policy, experts, slots)
        h, m = simulate(calls, slots, chosen, lane=_laned(lane, layer))
        hits += h
        misses += m
    return hits, misses


def _laned(lane: Sequence[bool], layer: int) -> bool:
    """Whether `layer`'s passes used the pass lane (past the list's end: they did not)."""
    return layer < len(lane) and bool(lane[layer])


def trace_policy(name: str | None) -> tuple[str, str]:
    """(label, registry name) of the daemon's policy named in a trace header; LRU when unknown."""
    if name in POLICIES:
        return name, name
    return f"{DEFAULT_POLICY} (the trace's policy {name!r} is unknown here)", DEFAULT_POLICY


# ---- the report -------------------------------------------------------------------------------


@dataclass
class LayerStats:
    layer: int
    unique: int
    experts: int
    top10_share: float  # share of routings that went to the 10% most used experts
    cover80: int  # experts that take 80% of the routings
    reuse: float  # mean share of a token's experts the previous token also chose
    recorded_hit_rate: float | None


@dataclass
class Report:
    files: list[str]
    model: str | None
    layers: int
    top_k: int
    experts: int
    expert_bytes: int
    tokens: int
    passes: int
    recorded_slots: int
    policy: str  # the daemon's policy as the report names it
    policy_name: str  # its registry name (a key of `curves`)
    per_layer: list[LayerStats]
    popularity: np.ndarray  # (L, E) routings per expert
    sizes: list[int]
    curves: dict[str, list[float]]  # registered policy (and "belady") -> hit rate per size
    recorded: dict[str, int]
    replay: dict | None
    pass_ms: list[float] = field(default_factory=list)
    pass_stall_ms: list[float] = field(default_factory=list)
    pass_router_ms: list[float] = field(default_factory=list)
    pass_rows: list[int] = field(default_factory=list)
    pass_classes: list[list[int]] = field(default_factory=list)  # per pass, counts per class

    def to_json(self) -> dict:
        return {
            "files": self.files,
            "model": self.model,
            "layers": self.layers,
            "top_k": self.top_k,
            "experts": self.experts,
            "expert_bytes": self.expert_bytes,
            "tokens": self.tokens,
            "passes": self.passes,
            "recorded_slots": self.recorded_slots,
            "policy": self.policy,
            "policy_name": self.policy_name,
            "per_layer": [vars(l) for l in self.per_layer],
            "sizes": self.sizes,
            "hit_rate": self.curves,
            "recorded": self.recorded,
            "replay": self.replay,
        }


def default_sizes(experts: int, recorded: int) -> list[int]:
    grid = np.unique(np.round(np.geomspace(1, experts, min(experts, 12))).astype(int))
    return sorted({int(s) for s in grid} | {int(recorded), int(experts)} - {0})


def _layer_calls(traces: list[Trace], layer: int) -> Calls:
    return [np.unique(p.ids[layer]).astype(np.int64) for t in traces for p in t.passes]


def _reuse(rows: np.ndarray) -> float:
    if len(rows) < 2:
        return 0.0
    k = rows.shape[1]
    prev, cur = rows[:-1], rows[1:]
    overlap = (cur[:, :, None] == prev[:, None, :]).any(axis=2).sum(axis=1)
    return float(overlap.mean() / k)


def analyze(
    traces: list[Trace],
    files: list[str],
    sizes: list[int] | None = None,
    progress: Callable[[int], None] | None = None,
) -> Report:
    """Analyse one or more traces of the same model, replayed in the order given."""
    first = traces[0].header
    for t in traces[1:]:
        if (t.header["layers"], t.header["experts"]) != (first["layers"], first["experts"]):
            raise ValueError(
                "traces of different models (layers/experts differ) cannot be analysed together"
            )
    L = int(first["layers"])
    E = int(max(first["experts"]))
    k = max(int(t.header.get("top_k") or 0) for t in traces)
    recorded_slots = int(min(first.get("slots_per_layer") or [E]))
    sizes = sorted(set(sizes)) if sizes else default_sizes(E, recorded_slots)
    policy_label, policy_name = trace_policy(first.get("policy"))
    tick = progress or (lambda n: None)

    per_layer, popularity = [], np.zeros((L, E), dtype=np.int64)
    names = [*POLICIES, BELADY]  # a column per registered policy, then the offline optimum
    totals = {name: np.zeros((len(sizes), 2), dtype=np.int64) for name in names}
    for layer in range(L):
        rows = np.concatenate([t.token_rows(layer) for t in traces]) if traces else np.zeros((0, k))
        counts = np.bincount(rows.reshape(-1).astype(np.int64), minlength=E)[:E]
        popularity[layer] = counts
        ranked = np.sort(counts)[::-1]
        total = max(1, int(ranked.sum()))
        top = max(1, int(round(E * 0.1)))
        cover = int(np.searchsorted(np.cumsum(ranked), 0.8 * total) + 1) if ranked.sum() else 0
        hits = sum(int(np.count_nonzero(p.classes[layer] == 0)) for t in traces for p in t.passes)
        looked = sum(int(p.classes[layer].size) for t in traces for p in t.passes)
        per_layer.append(
            LayerStats(
                layer,
                int(np.count_nonzero(counts)),
                E,
                float(ranked[:top].sum() / total),
                cover,
                _reuse(rows),
                hits / looked if looked else None,
            )
        )
        calls = _layer_calls(traces, layer)
        for i, s in enumerate(sizes):
            for name in POLICIES:
                totals[name][i] += simulate(calls, s, make_policy(name, E, s))
            totals[BELADY][i] += simulate_belady(calls, s)
            tick(1)
    curves = {
        name: [float(h / (h + m)) if h + m else 0.0 for h, m in arr] for name, arr in totals.items()
    }

    recorded: dict[str, int] = {c: 0 for c in CLASSES}
    for t in traces:
        for c, n in t.class_counts().items():
            recorded[c] += n
    replay = _replay(traces, policy_name, E) if len(traces) == 1 else None
    report = Report(
        files,
        first.get("model"),
        L,
        k,
        E,
        int(max(first.get("expert_bytes") or [0])),
        sum(t.tokens for t in traces),
        sum(len(t.passes) for t in traces),
        recorded_slots,
        policy_label,
        policy_name,
        per_layer,
        popularity,
        sizes,
        curves,
        recorded,
        replay,
    )
    for t in traces:
        for p in t.passes:
            report.pass_ms.append(p.ms)
            report.pass_stall_ms.append(p.stall_ms)
            report.pass_router_ms.append(p.router_ms)
            report.pass_rows.append(p.n)
            counts = np.zeros(len(CLASSES), dtype=np.int64)
            for c in p.classes:
                counts += np.bincount(c, minlength=len(CLASSES))[: len(CLASSES)]
            report.pass_classes.append(counts.tolist())
    return report


def _replay(traces: list[Trace], policy: str, E: int) -> dict:
    """Replay the recorded run (its slots, its starting cache, the daemon's policy): the hits must
    equal the recorded ones unless another request shared the cache meanwhile."""
    t = traces[0]
    slots = t.header.get("slots_per_layer") or []
    start = t.header.get("resident_at_start") or [[] for _ in slots]
    lane = t.header.get("pass_lane") or []  # absent from traces written before the lane
    hits = misses = 0
    for layer, s in enumerate(slots):
        h, m = simulate(
            _layer_calls([t], layer),
            int(s),
            make_policy(policy, E, int(s)),
            start[layer] if layer < len(start) else (),
            lane=_laned(lane, layer),
        )
        hits, misses = hits + h, misses + m
    rec = t.class_counts()
    rec_misses = rec["page_cache"] + rec["ssd"] + rec["read"]
    return {
        "hits": hits,
        "misses": misses,
        "recorded_hits": rec["hit"],
        "recorded_misses": rec_misses,
        "match": hits == rec["hit"] and misses == rec_misses,
        "warm_experts": sum(len(experts) for experts in start),  # cached when the run began
    }


# ---- text -------------------------------------------------------------------------------------


_gb = format_bytes  # the one byte formatter


def format_report(r: Report) -> str:
    lines = [
        f"trace     {', '.join(r.files)}",
        f"model     {r.model}: {r.layers} MoE layers x {r.experts} experts, top-{r.top_k}, "
        f"{_gb(r.expert_bytes)} per expert",
        f"tokens    {r.tokens} token rows in {r.passes} forward passes",
    ]
    looked = sum(r.recorded.values())
    if looked:
        lines.append(
            "recorded  "
            + "  ".join(f"{c} {n} ({n / looked:.1%})" for c, n in r.recorded.items())
            + f"   at {r.recorded_slots} slots/layer"
        )
    if r.replay:
        rp = r.replay
        lines.append(
            f"replay    {r.policy} from the recorded start: "
            f"{rp['hits']} hits / {rp['misses']} misses vs "
            f"{rp['recorded_hits']} / {rp['recorded_misses']} recorded "
            f"({'match' if rp['match'] else 'DIFFERENT'})"
        )
    lines += [
        "",
        "layer  distinct  top-10% share  experts for 80%  token-to-token reuse  recorded hit rate",
    ]
    for l in r.per_layer:
        rec = "-" if l.recorded_hit_rate is None else f"{l.recorded_hit_rate:.1%}"
        lines.append(
            f"{l.layer:>5}  {l.unique:>4}/{l.experts:<4} {l.top10_share:>12.1%}  {l.cover80:>15}  "
            f"{l.reuse:>20.1%}  {rec:>17}"
        )
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    lines.append(
        f"{'all':>5}  {mean([l.unique for l in r.per_layer]):>9.1f} "
        f"{mean([l.top10_share for l in r.per_layer]):>12.1%}  "
        f"{mean([l.cover80 for l in r.per_layer]):>15.1f}  "
        f"{mean([l.reuse for l in r.per_layer]):>20.1%}"
    )
    lines += [
        "",
        f"hit rate vs cache size, each simulated from an empty cache (the daemon ran {r.policy}; "
        f"{BELADY}: the offline optimum)",
        f"{'slots/layer':>11}  {'% experts':>9}  {'cache':>10}  "
        + "  ".join(f"{name:>7}" for name in r.curves),
    ]
    for i, s in enumerate(r.sizes):
        mark = recorded_mark(r) if s == r.recorded_slots else ""
        lines.append(
            f"{s:>11}  {s / r.experts:>9.1%}  {_gb(s * r.expert_bytes * r.layers):>10}  "
            + "  ".join(f"{curve[i]:>7.1%}" for curve in r.curves.values())
            + mark
        )
    return "\n".join(lines)


def recorded_mark(r: Report) -> str:
    """The recorded budget's row: the run's own hit rate (its cache may not have started empty)."""
    looked, warm = sum(r.recorded.values()), (r.replay or {}).get("warm_experts")
    rate = f": the run hit {r.recorded['hit'] / looked:.1%}" if looked else ""
    return f"  <- recorded{rate}" + (f", starting with {warm} experts cached" if warm else "")
