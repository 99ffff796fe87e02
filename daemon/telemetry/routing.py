"""Recorded routing, read from either kind of trace, and the expert cache's decode hit rate on it.

Two sources: moed's own `.moetrace` files (a daemon's requests, trace.py), and the JSON Lines
route traces of other engines (`.jsonl`, `.jsonl.gz`; ../shared/traces/README.md: a header line
`{"model", "layers", "experts", "top_k", ...}`, then one line per token `{"prompt", "pos",
"phase": "prefill"|"decode", "experts": [[ids of layer 0], ...]}`). Either becomes the passes the
daemon would run: a prompt's tokens read together (one pass, its experts the union of its rows),
each decode token alone.

`decode_hit_rate` replays them through `trace analyze`'s simulation (the daemon's slot table and
eviction policy) with a cache of a given share of the experts: the prompt fills the cache, the
decode tokens after it are counted. That is the rate the memory plan (`moed plan`) projects with.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moed.daemon.experts.policies import DEFAULT_POLICY, make_policy
from moed.daemon.telemetry.analyze import simulate
from moed.daemon.telemetry.trace import SUFFIX, Trace, TraceFormatError, read_trace


@dataclass(frozen=True)
class Routing:
    name: str
    model: str
    experts: int  # per layer
    top_k: int
    calls: list[list[np.ndarray]]  # [layer][pass]: the pass's distinct experts, ascending
    prompt: list[bool]  # per pass: it read a prompt (its hits are not counted)

    @property
    def layers(self) -> int:
        return len(self.calls)

    @property
    def decode_tokens(self) -> int:
        return self.prompt.count(False)


def from_trace(name: str, trace: Trace) -> Routing:
    """A daemon's trace: a pass of several rows read a prompt (one row: a decode token)."""
    calls = [
        [np.unique(p.ids[layer]).astype(np.int64) for p in trace.passes]
        for layer in range(trace.layers)
    ]
    return Routing(
        name,
        str(trace.header.get("model")),
        max(trace.num_experts),
        trace.top_k,
        calls,
        [p.n > 1 for p in trace.passes],
    )


def read_route_lines(path: Path) -> Routing:
    """The JSON Lines route trace at `path` (gzip'd when its name ends in .gz)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        lines = (json.loads(line) for line in f if line.strip())
        try:
            header = next(lines)
        except StopIteration:
            raise TraceFormatError(f"{path}: empty") from None
        try:
            layers, experts = int(header["layers"]), int(header["experts"])
            top_k = int(header["top_k"])
        except (KeyError, TypeError, ValueError):
            raise TraceFormatError(f"{path}: no layers/experts/top_k header line") from None
        passes: list[list[set[int]]] = []
        prompt: list[bool] = []
        open_prompt: tuple[int, int] | None = None  # (prompt, index of its pass) being read
        for rec in lines:
            rows = rec.get("experts")
            if not isinstance(rows, list) or len(rows) != layers:
                raise TraceFormatError(f"{path}: a record without {layers} layers of experts")
            if rec.get("phase") == "prefill":
                key = int(rec.get("prompt", 0))
                if open_prompt is None or open_prompt[0] != key:
                    passes.append([set() for _ in range(layers)])
                    prompt.append(True)
                    open_prompt = (key, len(passes) - 1)
                for layer, ids in enumerate(rows):
                    passes[open_prompt[1]][layer].update(int(e) for e in ids)
            else:
                open_prompt = None
                passes.append([{int(e) for e in ids} for ids in rows])
                prompt.append(False)
    calls = [
        [np.array(sorted(p[layer]), dtype=np.int64) for p in passes] for layer in range(layers)
    ]
    return Routing(path.name, str(header.get("model")), experts, top_k, calls, prompt)


def read_routing(path: Path) -> Routing:
    """A `.moetrace` or a JSON Lines route trace, by its name."""
    if path.name.endswith(SUFFIX):
        return from_trace(path.name, read_trace(path))
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        return read_route_lines(path)
    raise TraceFormatError(f"{path}: not a {SUFFIX} or .jsonl(.gz) trace")


def decode_hit_rate(
    routing: Routing, share: float, policy: str = DEFAULT_POLICY
) -> tuple[int, int]:
    """(hits, lookups) of the decode tokens with `share` of each layer's experts cached (at
    least one slot), the prompts before them filling the cache: `trace analyze`'s simulation."""
    slots = max(1, min(routing.experts, round(share * routing.experts)))
    counted = [not p for p in routing.prompt]
    hits = lookups = 0
    for calls in routing.calls:
        h, m = simulate(calls, slots, make_policy(policy, routing.experts, slots), counted=counted)
        hits, lookups = hits + h, lookups + h + m
    return hits, lookups
