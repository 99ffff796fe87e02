"""The memory plan of a published model on a machine it was never loaded on, and what it projects.

From a config.json alone: the tensors mlx-lm would load (replica_layout.py: its own model, built
lazily), split as the daemon splits them (stacked experts stream, the rest stays resident; the
vision tower and MTP layers that mlx-lm's sanitize drops are left out, as experts/memory_plan.py
leaves them out of a checkpoint's plan). The plan itself is the daemon's (`make_plan`): the same
KV room for `plan_context_tokens`, prefix-cache share, working memory and pass lane, with `auto`
as the cache budget.

Then, at the plan's share of each layer's experts, the expected decode hit rate (the daemon's
default eviction policy replayed on recorded routing: telemetry/routing.py), the expert bytes a
token reads, and a PROJECTED decode speed: one token per

    resident compute (active bytes / memory bandwidth)
    + MoE layers x (host time per streamed layer call + one router read-back)
    + bytes read at the SSD's speed (no read overlapping compute: the serial floor)

with every expert held (a budget of 100%) layer calls routed on the device: no read-back, the held
host time per call. The inputs are measurements from BENCHMARKS.md, named in `Inputs`; nothing
here was measured on the machine it projects.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from moed.daemon.bench.replica_layout import EXPERT_TENSOR, TensorSpec, text_tensors
from moed.daemon.experts.memory_plan import (
    ExpertLayout,
    MemoryPlan,
    estimate_kv_bytes,
    make_plan,
)
from moed.daemon.telemetry.routing import Routing, decode_hit_rate
from moed.protocol.model_config import ModelConfig

PLAN_CONTEXT_TOKENS = 8192  # ServeConfig.plan_context_tokens' default: the KV room a daemon plans
_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Inputs:
    """What a projection assumes, each from a measurement in BENCHMARKS.md unless said."""

    # Host time per streamed layer call (a budget below 100%): the H200 host's 25% row, "Submitting
    # each streamed layer early, and the serial floor" (498 us).
    host_us_per_call: float = 498.0
    # Host time per layer call with every expert held, routed on the device: the same run's
    # 100%+pre row (44 us).
    held_host_us_per_call: float = 44.0
    # One router read-back (a host sync) per streamed layer call: the same run's 100%+pre,host
    # against 100%+pre, (7.50 - 4.31) ms a token over 8 read-backs (399 us).
    readback_us: float = 399.0
    # The machine's memory bandwidth for the resident compute: Apple's figure for the M4 of the
    # 16-32 GB Mac mini (120 GB/s; M4 Pro 273, M4 Max 546). Not a measurement.
    memory_bandwidth: float = 120e9
    # Usable share of RAM: Metal's recommended working set, as BENCHMARKS.md takes it (75%).
    usable_share: float = 0.75
    ssd_bandwidths: tuple[float, ...] = (3e9, 6e9)


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int  # MoE layers
    experts: int  # per layer
    top_k: int
    layout: ExpertLayout
    resident_bytes: int  # the non-expert weights mlx-lm loads
    active_bytes: int  # read per decode token when resident: all but the embedding, + top-k experts
    kv_bytes: int  # the KV room the daemon's plan keeps (PLAN_CONTEXT_TOKENS)

    @property
    def expert_bytes(self) -> int:
        return max(self.layout.expert_bytes)


def model_shape(name: str, config: Mapping[str, Any]) -> ModelShape:
    read = ModelConfig.from_dict(config)
    if not read.is_moe:
        raise ValueError(f"{name}: not a Mixture-of-Experts model (no routed experts)")
    specs = text_tensors(config)
    per_layer: dict[int, list[TensorSpec]] = {}
    resident = embedding = 0
    for s in specs:
        if EXPERT_TENSOR.search(s.name):
            m = _LAYER.search(s.name)
            per_layer.setdefault(int(m.group(1)) if m else -1, []).append(s)
        else:
            resident += s.nbytes
            if "embed_tokens" in s.name:
                embedding += s.nbytes  # one row a token is read
    layers = [per_layer[k] for k in sorted(per_layer)]
    layout = ExpertLayout(
        [sum(s.nbytes // s.shape[0] for s in layer) for layer in layers],
        [layer[0].shape[0] for layer in layers],
    )
    k = read.experts_per_token or 1
    return ModelShape(
        name,
        len(layers),
        max(layout.num_experts),
        k,
        layout,
        resident,
        resident - embedding + k * sum(layout.expert_bytes),
        estimate_kv_bytes(read, PLAN_CONTEXT_TOKENS),
    )


@dataclass(frozen=True)
class PlanRow:
    memory: int  # the machine's RAM
    plan: MemoryPlan
    share: float  # of each layer's experts the cache holds
    hit_rate: float | None  # None: no routing to replay, or the model does not fit
    bytes_per_token: float | None
    projected_tok_s: dict[float, float] = field(default_factory=dict)  # SSD bytes/s -> tok/s

    def to_json(self) -> dict[str, Any]:
        return {
            "memory_bytes": self.memory,
            "usable_bytes": self.plan.usable_memory,
            "fits": self.plan.fits,
            "budget_bytes": self.plan.cache_budget_bytes,
            "slots_per_layer": self.plan.slots_per_layer,
            "share": self.share,
            "hit_rate": self.hit_rate,
            "bytes_per_token": self.bytes_per_token,
            "projected_tok_s": {f"{b / 1e9:g}GB/s": v for b, v in self.projected_tok_s.items()},
            "plan": asdict(self.plan),
        }


def hit_rate(routings: Sequence[Routing], share: float) -> float | None:
    """Decode hits over lookups of every routing at `share`; every expert held stays: 1.0."""
    if share >= 1.0:
        return 1.0
    hits = lookups = 0
    for r in routings:
        h, n = decode_hit_rate(r, share)
        hits, lookups = hits + h, lookups + n
    return hits / lookups if lookups else None


def plan_row(
    shape: ModelShape,
    memory: int,
    routings: Sequence[Routing],
    inputs: Inputs,
    baseline_bytes: int,
) -> PlanRow:
    usable = int(memory * inputs.usable_share)
    plan = make_plan(
        shape.layout,
        shape.resident_bytes,
        "auto",
        kv_bytes=shape.kv_bytes,
        baseline_bytes=baseline_bytes,
        memory=(memory, usable, f"{inputs.usable_share:.0%} of RAM"),
        prefix_cache_bytes=None,  # the daemon's automatic share
        pass_lane=True,  # Metal lands reads directly, beside the lane
    )
    share = plan.slots_per_layer / shape.experts if shape.experts else 0.0
    if not plan.fits:
        return PlanRow(memory, plan, share, None, None)
    rate = hit_rate(routings, share)
    if rate is None:
        return PlanRow(memory, plan, share, None, None)
    misses = (1.0 - rate) * shape.top_k * shape.layers
    per_token = misses * shape.expert_bytes
    held = share >= 1.0
    host_us = inputs.held_host_us_per_call if held else inputs.host_us_per_call
    sync_us = 0.0 if held else inputs.readback_us
    fixed = shape.active_bytes / inputs.memory_bandwidth + shape.layers * (host_us + sync_us) / 1e6
    projected = {b: 1.0 / (fixed + per_token / b) for b in inputs.ssd_bandwidths}
    return PlanRow(memory, plan, share, rate, per_token, projected)
