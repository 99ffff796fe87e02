"""Next-layer prediction's recall per layer: of the experts a layer's call picked, the share the
prediction made before its router ran had found (issue 36, deliverable 4).

Three predictors. The gate, the next layer's router on this layer's input (what the streamer's
lookahead reads ahead, experts/lookahead.py), counts itself while a model decodes; it needs the
hidden states, so a recorded routing trace cannot score it. From routing alone: `reuse`, the
same layer's experts of the token before, and `co-occurrence`, the experts that followed the
layer before's picks most often over the earlier tokens (learnt as it goes, nothing ahead). Both
are scored here on decode tokens of a trace: a contender's own (bench stream) or a recorded one
(../shared/traces, `moed bench recall`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import click
import numpy as np

from moed.daemon.bench.stream_report import RunResult, paired_speed
from moed.daemon.telemetry.routing import Routing, read_routing
from moed.daemon.telemetry.trace import TraceFormatError

Pairs = list[tuple[int, int]]  # per layer: (experts found, experts picked)
LAYERS_PER_LINE = 16


def decode_tokens(routing: Routing) -> list[list[set[int]]]:
    """The decode tokens' picks, token by token: per layer, a set of experts."""
    return [
        [{int(e) for e in routing.calls[layer][i]} for layer in range(routing.layers)]
        for i, prompt in enumerate(routing.prompt)
        if not prompt
    ]


def routing_recall(
    tokens: Sequence[Sequence[set[int]]], experts: int, top_k: int
) -> dict[str, Pairs]:
    """`reuse` and `co-occurrence` recall per layer over `tokens` (each: per layer, the picked
    experts). A layer's first token has nothing to reuse; co-occurrence starts at layer 1."""
    layers = len(tokens[0]) if tokens else 0
    reuse = [[0, 0] for _ in range(layers)]
    cooc = [[0, 0] for _ in range(layers)]
    counts = np.zeros((max(layers, 1), experts, experts), dtype=np.int64)  # [layer, before, this]
    for t, tok in enumerate(tokens):
        for layer, picked in enumerate(tok):
            if t > 0:
                found = len(picked & tokens[t - 1][layer])
                reuse[layer][0] += found
                reuse[layer][1] += len(picked)
            if layer > 0 and t > 0:
                before = sorted(tok[layer - 1])
                score = counts[layer, before].sum(axis=0)
                guess = (
                    set(np.argsort(-score, kind="stable")[:top_k].tolist())
                    if score.any()
                    else set()
                )
                cooc[layer][0] += len(picked & guess)
                cooc[layer][1] += len(picked)
        for layer in range(1, layers):  # learnt after the token: no prediction sees its own
            before, now = sorted(tok[layer - 1]), sorted(tok[layer])
            counts[layer][np.ix_(before, now)] += 1
    return {
        "reuse": [(a, b) for a, b in reuse],
        "co-occurrence": [(a, b) for a, b in cooc],
    }


def _pct(found: int, wanted: int) -> str:
    return f"{100 * found / wanted:3.0f}" if wanted else "  -"


def mean_recall(pairs: Pairs) -> float | None:
    found, wanted = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
    return found / wanted if wanted else None


def recall_lines(label: str, pairs: Pairs, width: int = 34) -> list[str]:
    """One predictor's recall per layer in percent, LAYERS_PER_LINE layers a line, then the
    mean over every layer's picks."""
    mean = mean_recall(pairs)
    tail = f"  mean {100 * mean:.0f}%" if mean is not None else "  mean -"
    cells = [_pct(f, w) for f, w in pairs]
    lines = []
    for start in range(0, max(1, len(cells)), LAYERS_PER_LINE):
        chunk = " ".join(cells[start : start + LAYERS_PER_LINE])
        head = label if start == 0 else f"  (layers {start}-)"
        lines.append(f"  {head:<{width}} {chunk}")
    lines[-1] += tail
    return lines


def trace_report(routing: Routing) -> str:
    tokens = decode_tokens(routing)
    rec = routing_recall(tokens, routing.experts, routing.top_k)
    out = [
        f"{routing.name}: {routing.model}; {routing.layers} layers x {routing.experts} experts, "
        f"top-{routing.top_k}; {len(tokens)} decode tokens",
        f"  recall per layer, % of each layer's picks (layers 0-{routing.layers - 1}):",
    ]
    out += recall_lines("reuse (token before, same layer)", rec["reuse"])
    out += recall_lines("co-occurrence (layer before)", rec["co-occurrence"])
    return "\n".join(out)


@click.command("recall")
@click.argument("traces", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
def recall(traces: tuple[Path, ...]) -> None:
    """Next-layer prediction's recall per layer on recorded routing traces (.moetrace, or the
    JSON Lines route traces of ../shared/traces): the predictors that need only the routing.
    The gate (the next router on this layer's input) needs hidden states: `moed bench stream
    --look-budgets` measures it on a model."""
    for path in traces:
        try:
            routing = read_routing(path)
        except (OSError, TraceFormatError, ValueError) as exc:
            raise click.BadParameter(f"{path}: {exc}", param_hint="TRACES") from None
        click.echo(trace_report(routing) + "\n")


def decode_steps(trace: Sequence[Sequence[np.ndarray]], top_k: int) -> list[list[set[int]]]:
    """A streamer's recorded steps (`record_routing`) that decoded one token: no layer picked
    more than top-k experts."""
    return [
        [{int(e) for e in layer} for layer in step]
        for step in trace
        if step and all(len(layer) <= top_k for layer in step)
    ]


def lookahead_lines(runs: Sequence[RunResult]) -> list[str]:
    """Each `+look` row beside the same budget without it, and its recall per layer."""
    by_name = {r.name: r for r in runs}
    out: list[str] = []
    for run in runs:
        look = run.lookahead
        if not look:
            continue
        if not out:
            out.append(
                "idle-disk lookahead (experts/lookahead.py): the next layer's router on this "
                "layer's input; its guesses read into a lane only while no demand read is queued "
                "or running, copied into the slot the layer's own admission gives them"
            )
        base = by_name.get(run.name.replace("+look", ""))
        n = max(1, run.decode_tokens)
        guessed, served = look["lookahead_guessed"], look["lookahead_served"]
        line = f"  {run.name}"
        if base is not None:
            before = base.counters["bytes_read"] / max(1, base.decode_tokens) / 1e6
            after = run.counters["bytes_read"] / n / 1e6
            line += (
                f" vs {base.name}: tok/s x{paired_speed(run, base):.2f} (paired per round), "
                f"demand reads {before:.1f} -> {after:.1f} MB/tok, same tokens: "
                f"{'yes' if run.tokens == base.tokens else 'NO'}"
            )
        out.append(line)
        out.append(
            f"    {served} of {guessed} experts read ahead were served"
            f" ({100 * served / guessed if guessed else 0:.0f}%), "
            f"{look['lookahead_expired']} expired unread, {look['lookahead_wasted']} read and "
            f"not picked; waits for a lane {1e3 * look['lookahead_wait_s'] / n:.2f} ms/tok"
        )
        out.append("    recall per layer, % of each layer's picks, decode tokens:")
        gate = [(int(f), int(w)) for f, w in look["lookahead_recall"]]
        out += recall_lines("  gate (next router, this input)", gate)
        for label, pairs in (look.get("routing") or {}).items():
            out += recall_lines(f"  {label} (same run)", pairs)
    return out
