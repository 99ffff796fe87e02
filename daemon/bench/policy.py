"""`moed bench policy`: every registered eviction policy replayed on recorded router traces.

Each trace is held out in turn: a policy's parameters are fitted (grid search, per cache size) on
the other traces and the hit rate is measured on the held-out one, so no policy is judged on the
data it was tuned on. The replay is the daemon's own slot table and pass planning
(experts/slots.py through `moed trace analyze`'s `simulate`); Belady's offline optimum bounds it.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from moed.daemon.experts.policies import DEFAULT_POLICY, POLICIES, make_policy
from moed.daemon.telemetry.analyze import BELADY, simulate, simulate_belady
from moed.daemon.telemetry.trace import Trace, read_trace

TRACES = Path(__file__).resolve().parents[2] / "benchmarks" / "traces"  # in a source checkout


@dataclass(frozen=True)
class Workload:
    name: str
    calls: list[list[np.ndarray]]  # per layer: the distinct experts of each layer call
    experts: int


def workload(name: str, trace: Trace) -> Workload:
    calls = [
        [np.unique(p.ids[layer]).astype(np.int64) for p in trace.passes]
        for layer in range(trace.layers)
    ]
    return Workload(name, calls, max(trace.num_experts))


def param_sets(policy: str) -> list[dict]:
    grid = POLICIES[policy].PARAM_GRID
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def replay(w: Workload, policy: str, slots: int, params: dict) -> tuple[int, int]:
    hits = misses = 0
    for calls in w.calls:
        if policy == BELADY:
            h, m = simulate_belady(calls, slots)
        else:
            h, m = simulate(calls, slots, make_policy(policy, w.experts, slots, **params))
        hits, misses = hits + h, misses + m
    return hits, misses


def _rate(hm: np.ndarray) -> float:
    return float(hm[0] / hm.sum()) if hm.sum() else 0.0


def held_out(workloads: list[Workload], shares: list[float]) -> dict:
    """Per policy and share: held-out hit rate (pooled over traces), per-trace rates, and the
    parameters chosen most often."""
    experts = workloads[0].experts
    sizes = [max(1, round(s * experts)) for s in shares]
    names = [*POLICIES, BELADY]
    # results[policy][param index][size index][trace] = (hits, misses)
    results: dict[str, list] = {}
    for name in names:
        sets = param_sets(name) if name in POLICIES else [{}]
        results[name] = [
            [[replay(w, name, size, ps) for w in workloads] for size in sizes] for ps in sets
        ]
    out: dict = {"sizes": sizes, "shares": shares, "traces": [w.name for w in workloads]}
    # What the daemon runs: each policy with its shipped parameters, on every trace.
    out["defaults"] = {
        name: [
            _rate(np.array([replay(w, name, size, {}) for w in workloads]).sum(axis=0))
            for size in sizes
        ]
        for name in POLICIES
    }
    for name in names:
        sets = param_sets(name) if name in POLICIES else [{}]
        table = np.array(results[name], dtype=np.int64)  # (params, sizes, traces, 2)
        rows = []
        for si in range(len(sizes)):
            pooled = np.zeros(2, dtype=np.int64)
            per_trace, chosen = [], []
            for ti in range(len(workloads)):
                others = np.delete(table[:, si], ti, axis=1).sum(axis=1)  # (params, 2)
                best = int(np.argmax([_rate(o) for o in others]))
                pooled += table[best, si, ti]
                per_trace.append(_rate(table[best, si, ti]))
                chosen.append(best)
            common = max(set(chosen), key=chosen.count)
            rows.append(
                {
                    "hit_rate": _rate(pooled),
                    "per_trace": per_trace,
                    "params": sets[common],
                    "in_sample_best": _rate(table[:, si].sum(axis=1).max(axis=0))
                    if len(sets) == 1
                    else max(_rate(table[p, si].sum(axis=0)) for p in range(len(sets))),
                }
            )
        out[name] = rows
    return out


def report(res: dict) -> str:
    shares = res["shares"]
    head = "  ".join(f"{f'{100 * s:g}% ({n})':>12}" for s, n in zip(shares, res["sizes"]))
    lines = [
        f"moed bench policy: {len(res['traces'])} traces, each held out in turn (parameters "
        "fitted on the others, per cache size); hit rate pooled over the held-out traces",
        "",
        f"{'policy':>8}  {head}   parameters chosen (per size)",
    ]
    names = [n for n in res if n in POLICIES or n == BELADY]
    lru = res["lru"]
    for name in names:
        rows = res[name]
        cells = "  ".join(f"{100 * r['hit_rate']:>12.1f}" for r in rows)
        params = "; ".join(
            ", ".join(f"{k}={v:g}" for k, v in r["params"].items()) or "-" for r in rows
        )
        lines.append(f"{name:>8}  {cells}   {params}")
    lines += ["", "points over LRU (held out):"]
    for name in names:
        if name == "lru":
            continue
        cells = "  ".join(
            f"{100 * (r['hit_rate'] - l['hit_rate']):>+12.1f}" for r, l in zip(res[name], lru)
        )
        wins = [
            sum(a > b for a, b in zip(r["per_trace"], l["per_trace"]))
            for r, l in zip(res[name], lru)
        ]
        lines.append(
            f"{name:>8}  {cells}   traces won vs LRU: "
            + ", ".join(f"{w}/{len(res['traces'])}" for w in wins)
        )
    lines += ["", "with the daemon's parameters (the policies' defaults, no fitting):"]
    for name, rates in res["defaults"].items():
        cells = "  ".join(f"{100 * r:>12.1f}" for r in rates)
        lines.append(f"{name:>8}  {cells}")
    online = [n for n in names if n in POLICIES]
    mid = shares.index(0.25) if 0.25 in shares else len(shares) // 2
    best = max(online, key=lambda n: res[n][mid]["hit_rate"])
    lines += [
        "",
        f"best online policy at {100 * shares[mid]:g}%: {best}; the daemon's default: "
        f"{DEFAULT_POLICY}",
    ]
    return "\n".join(lines)


@click.command("policy")
@click.option(
    "--traces",
    "trace_dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=TRACES,
    show_default=True,
    help="a folder of .moetrace files of one model (moe run --trace)",
)
@click.option(
    "--shares",
    default="0.125,0.25,0.5",
    show_default=True,
    help="cache sizes as shares of each layer's experts",
)
@click.option("--json", "as_json", is_flag=True, help="print the results as JSON")
def policy(trace_dir: Path, shares: str, as_json: bool) -> None:
    """Hit rate of every registered eviction policy on held-out router traces."""
    files = sorted(trace_dir.glob("*.moetrace"))
    if len(files) < 2:
        raise click.ClickException(f"{trace_dir}: need at least two .moetrace files")
    traces = [read_trace(f) for f in files]
    shape = {(t.layers, tuple(t.num_experts)) for t in traces}
    if len(shape) != 1:
        raise click.ClickException("the traces come from different models")
    workloads = [workload(f.stem, t) for f, t in zip(files, traces)]
    res = held_out(workloads, [float(s) for s in shares.split(",") if s.strip()])
    click.echo(json.dumps(res, indent=2, default=float) if as_json else report(res))
