"""`moed plan MODEL... --memory 16GB,24GB,...`: the memory plan of a model on machines of each
size, from its config.json alone, and the decode speed that plan projects (plan_model.py).

MODEL is a checkpoint folder, a config.json, or a published name (`qwen3.6-35b-a3b-4bit`,
`qwen3.5-122b-a10b-4bit`: bench/published/). The hit rate replays recorded routing: the demo
model's traces in benchmarks/traces (a source checkout) unless `--trace` names others (`.moetrace`,
or the JSON Lines route traces of ../shared/traces).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import click

from moed.daemon.bench.published_models import PublishedModel
from moed.protocol.units import format_bytes

DEMO_TRACES = Path(__file__).resolve().parents[2] / "benchmarks" / "traces"
DEFAULT_MEMORY = "16GB,24GB,32GB,64GB,128GB"
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(gb|g|gib)?\s*$", re.IGNORECASE)
PROJECTED_NOTE = (
    "projected: not measured on these machines. One decode token per (active bytes / memory "
    "bandwidth + MoE layers x (host us per streamed layer call + one router read-back) + bytes "
    "read / SSD bandwidth); with every expert held, layer calls route on the device (no read-back, "
    "held host us per call). Inputs:"
)


def parse_memory(spec: str) -> list[int]:
    """`16GB,24GB` as Macs are sold: 16GB is 16 GiB of RAM."""
    sizes = []
    for part in spec.split(","):
        m = _MEMORY.match(part)
        if not m or float(m.group(1)) <= 0:
            raise click.BadParameter(f"{part!r} is not a memory size (use 16GB,24GB,...)")
        sizes.append(int(float(m.group(1)) * 2**30))
    return sizes


def read_config(model: str) -> tuple[str, dict[str, Any]]:
    """(name, config.json) of a published name, a folder or a config.json file."""
    names = {p.value: p for p in PublishedModel}
    if model in names:
        published = names[model]
        return published.repo, published.config()
    path = Path(model)
    file = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise click.BadParameter(
            f"{model}: no readable config.json ({exc}); or one of {', '.join(names)}",
            param_hint="MODEL",
        ) from None
    if not isinstance(config, dict):
        raise click.BadParameter(f"{file} is not a JSON object", param_hint="MODEL")
    return str(path), config


@click.command("plan")
@click.argument("models", nargs=-1, required=True, metavar="MODEL...")
@click.option(
    "--memory",
    default=DEFAULT_MEMORY,
    show_default=True,
    help="RAM of each machine, comma-separated (16GB is 16 GiB, as Macs are sold).",
)
@click.option(
    "--trace",
    "traces",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Routing to replay for the hit rate (.moetrace, or a .jsonl/.jsonl.gz route trace); "
    "repeatable. Default: the demo model's traces in benchmarks/traces.",
)
@click.option(
    "--host-us",
    type=float,
    default=None,
    help="Host time per streamed layer call, us (default: the H200 host's 25% row, 498).",
)
@click.option(
    "--readback-us",
    type=float,
    default=None,
    help="One router read-back (host sync), us (default: the H200 host's, 399).",
)
@click.option(
    "--memory-bandwidth",
    type=float,
    default=None,
    help="Memory bandwidth for the resident compute, GB/s (default: 120, an M4).",
)
@click.option(
    "--ssd",
    default="3,6",
    show_default=True,
    help="SSD read bandwidths to project at, GB/s, comma-separated.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plans as JSON.")
def plan(
    models: tuple[str, ...],
    memory: str,
    traces: tuple[Path, ...],
    host_us: float | None,
    readback_us: float | None,
    memory_bandwidth: float | None,
    ssd: str,
    as_json: bool,
) -> None:
    """The memory plan of each MODEL (a folder, a config.json, or a published name) on machines of
    each --memory size: the expert cache budget, the expected hit rate there, the bytes a decode
    token reads, and the decode speed that PROJECTS to at each --ssd bandwidth."""
    # mlx-lm (with transformers) on use: every `moed` command imports the command modules
    import mlx_lm  # noqa: F401 - imported before the baseline is read, as a daemon has it

    # and what plans with it (mlx, numpy), loaded only when the command runs
    from moed.daemon.bench.plan_model import Inputs, model_shape, plan_row
    from moed.daemon.experts.memory_plan import process_rss
    from moed.daemon.telemetry.routing import read_routing
    from moed.daemon.telemetry.trace import TraceFormatError

    # The process as a daemon is before its weights load: the plan's baseline.
    baseline = process_rss()
    sizes = parse_memory(memory)
    try:
        ssds = tuple(float(s) * 1e9 for s in ssd.split(",") if s.strip())
    except ValueError:
        raise click.BadParameter(
            f"{ssd!r}: GB/s numbers, comma-separated", param_hint="--ssd"
        ) from None
    if not ssds or min(ssds) <= 0:
        raise click.BadParameter("at least one positive bandwidth", param_hint="--ssd")
    inputs = Inputs(ssd_bandwidths=ssds)
    if host_us is not None:
        inputs = replace(inputs, host_us_per_call=host_us)
    if readback_us is not None:
        inputs = replace(inputs, readback_us=readback_us)
    if memory_bandwidth is not None:
        inputs = replace(inputs, memory_bandwidth=memory_bandwidth * 1e9)
    files = list(traces) or sorted(DEMO_TRACES.glob("*.moetrace"))
    if not files:
        raise click.UsageError("no routing to replay: pass --trace (benchmarks/traces is absent)")
    try:
        routings = [read_routing(f) for f in files]
    except (TraceFormatError, OSError, ValueError, KeyError) as exc:
        raise click.ClickException(f"cannot read a trace: {exc}") from None
    shapes = []
    for model in models:
        name, config = read_config(model)
        try:
            shapes.append(model_shape(name, config))
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="MODEL") from None
    results = [(s, [plan_row(s, m, routings, inputs, baseline) for m in sizes]) for s in shapes]
    if as_json:
        click.echo(json.dumps(_json(results, routings, inputs, baseline), indent=1))
        return
    for shape, rows in results:
        click.echo(_table(shape, rows, inputs))
        click.echo("")
    click.echo(_footer(routings, inputs, baseline))


def _table(shape: Any, rows: list[Any], inputs: Any) -> str:
    lines = [
        f"{shape.name}: {shape.layers} MoE layers x {shape.experts} experts (top-{shape.top_k}), "
        f"one expert {format_bytes(shape.expert_bytes)}, experts "
        f"{format_bytes(shape.layout.experts_bytes)}; resident weights "
        f"{format_bytes(shape.resident_bytes)}, KV room {format_bytes(shape.kv_bytes)}",
        f"{'memory':>7} {'usable':>9} {'budget':>9} {'share':>6} {'slots':>5} {'hit%':>6} "
        f"{'MB/token':>9}  "
        + "  ".join(
            f"{'projected tok/s @' + format(b / 1e9, 'g') + ' GB/s':>26}"
            for b in inputs.ssd_bandwidths
        ),
    ]
    for r in rows:
        head = f"{r.memory / 2**30:>5.0f}GB {format_bytes(r.plan.usable_memory):>9}"
        if not r.plan.fits:
            lines.append(
                f"{head} does not fit: needs {format_bytes(r.plan.required_bytes)} with one "
                "slot per layer"
            )
            continue
        rate = "-" if r.hit_rate is None else f"{100 * r.hit_rate:.1f}"
        mb = "-" if r.bytes_per_token is None else f"{r.bytes_per_token / 1e6:.1f}"
        lines.append(
            f"{head} {format_bytes(r.plan.cache_budget_bytes):>9} {r.share:>6.0%} "
            f"{r.plan.slots_per_layer:>5} {rate:>6} {mb:>9}  "
            + "  ".join(f"{r.projected_tok_s.get(b, 0.0):>26.1f}" for b in inputs.ssd_bandwidths)
        )
    return "\n".join(lines)


def _footer(routings: list[Any], inputs: Any, baseline: int) -> str:
    traces = ", ".join(
        f"{r.name} ({r.experts} experts, {r.decode_tokens} decode tokens)" for r in routings[:4]
    )
    more = f" and {len(routings) - 4} more" if len(routings) > 4 else ""
    return "\n".join(
        [
            "share: of each layer's experts the plan's cache holds; hit%: the default eviction "
            f"policy's decode hit rate at that share of the experts of {traces}{more} (prompts "
            "fill the cache, decode tokens counted; every expert held: 100%); MB/token: misses "
            "x top-k x layers x one expert.",
            PROJECTED_NOTE,
            f"  host us per streamed layer call {inputs.host_us_per_call:g}, held "
            f"{inputs.held_host_us_per_call:g}; router read-back {inputs.readback_us:g} us "
            "(BENCHMARKS.md, the H200 host, issue 22's fifth session);",
            f"  memory bandwidth {inputs.memory_bandwidth / 1e9:g} GB/s (Apple's M4; not "
            f"measured); usable {inputs.usable_share:.0%} of RAM (Metal's recommended working "
            "set); the plan's KV room for 8192 tokens, prefix cache and working memory as the "
            f"daemon plans them, its process baseline this one's ({format_bytes(baseline)}).",
        ]
    )


def _json(results: list[Any], routings: list[Any], inputs: Any, baseline: int) -> dict[str, Any]:
    return {
        "projected": True,
        "inputs": asdict(inputs),
        "baseline_bytes": baseline,
        "traces": [
            {
                "name": r.name,
                "model": r.model,
                "experts": r.experts,
                "top_k": r.top_k,
                "decode_tokens": r.decode_tokens,
            }
            for r in routings
        ],
        "models": [
            {
                "name": shape.name,
                "layers": shape.layers,
                "experts": shape.experts,
                "top_k": shape.top_k,
                "expert_bytes": shape.expert_bytes,
                "experts_bytes": shape.layout.experts_bytes,
                "resident_bytes": shape.resident_bytes,
                "active_bytes": shape.active_bytes,
                "kv_bytes": shape.kv_bytes,
                "rows": [r.to_json() for r in rows],
            }
            for shape, rows in results
        ],
    }
