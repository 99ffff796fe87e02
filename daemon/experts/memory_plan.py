"""The memory plan: resident weights + expert cache + KV cache + working memory against what the
machine can give, computed before the experts are loaded."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import psutil

from moed.daemon.experts.budget import CacheBudget, slots_per_layer
from moed.daemon.experts.cuda_memory import on_cuda
from moed.daemon.experts.landing import Landing
from moed.daemon.experts.safetensors_index import CheckpointIndex
from moed.daemon.experts.streaming_config import StreamingConfig
from moed.protocol.model_config import ModelConfig
from moed.protocol.units import format_bytes

GB = 1e9
LINUX_USABLE_FRACTION = 0.85  # leave the rest to the OS and other processes
MIN_WORKING_BYTES = 32 * 2**20

# Stacked expert tensors of stock mlx-lm checkpoints (SwitchGLU / SwitchMLP owners in any arch).
_EXPERT_TENSOR = re.compile(
    r"^(?P<owner>.*\.(?:switch_mlp|experts))\.(?P<proj>gate_proj|up_proj|down_proj|fc1|fc2)\.(?P<param>weight|scales|biases|bias|global_scale)$"
)


@dataclass(frozen=True)
class MemoryPlan:
    total_memory: int  # what the machine (or its cgroup) has
    usable_memory: int  # what the plan may use (Metal: recommended working set)
    memory_source: str
    resident_bytes: int  # non-expert weights, materialized
    experts_bytes: int  # all routed experts on disk
    cache_budget_bytes: int  # slot pools actually allocated
    kv_bytes: int
    working_bytes: int
    baseline_bytes: int  # the process before any weights: interpreter, libraries
    num_layers: int
    slots_per_layer: int
    num_experts: int  # per layer
    prefix_cache_bytes: int = 0  # the prefix KV cache's memory tier (engine/prefix_cache/)
    lane_bytes: int = 0  # the pass lane (pass_lane.py): one more pool of a layer's slots

    @property
    def required_bytes(self) -> int:
        return (
            self.baseline_bytes
            + self.resident_bytes
            + self.cache_budget_bytes
            + self.lane_bytes
            + self.kv_bytes
            + self.prefix_cache_bytes
            + self.working_bytes
        )

    @property
    def fits(self) -> bool:
        return self.required_bytes <= self.usable_memory

    def describe(self) -> str:
        pct = 100.0 * self.cache_budget_bytes / self.experts_bytes if self.experts_bytes else 0.0
        verdict = "fits" if self.fits else "DOES NOT FIT"
        return "\n".join(
            [
                f"memory plan ({verdict}): {_gb(self.usable_memory)} usable of "
                f"{_gb(self.total_memory)} ({self.memory_source})",
                f"  process baseline {_gb(self.baseline_bytes):>10}",
                f"  resident weights {_gb(self.resident_bytes):>10}",
                f"  expert cache     {_gb(self.cache_budget_bytes):>10}  "
                f"({pct:.0f}% of {_gb(self.experts_bytes)} of experts: "
                f"{self.slots_per_layer} of {self.num_experts} slots x {self.num_layers} layers)",
                f"  pass lane        {_gb(self.lane_bytes):>10}",
                f"  KV cache         {_gb(self.kv_bytes):>10}",
                f"  prefix cache     {_gb(self.prefix_cache_bytes):>10}",
                f"  working memory   {_gb(self.working_bytes):>10}",
                f"  total            {_gb(self.required_bytes):>10}",
            ]
        )

    def refusal(self) -> str:
        return (
            f"the model does not fit: it needs {_gb(self.required_bytes)} "
            f"but only {_gb(self.usable_memory)} is usable "
            f"({self.memory_source}); "
            f"lower --cache-budget (now {_gb(self.cache_budget_bytes)}) or the context length"
        )


_gb = format_bytes  # the one byte formatter


def cgroup_memory_limit() -> int | None:
    """The tightest memory limit of this process's cgroup and its ancestors (v2 memory.max or
    v1 memory.limit_in_bytes), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _id, controllers, rel = line.split(":", 2)
        if controllers == "":
            limits.append(_walk_limit(Path("/sys/fs/cgroup"), rel, "memory.max"))
        elif "memory" in controllers.split(","):
            limits.append(_walk_limit(Path("/sys/fs/cgroup/memory"), rel, "memory.limit_in_bytes"))
    found = [n for n in limits if n is not None]
    return min(found) if found else None


_UNLIMITED_V1 = 1 << 62  # v1 reports "no limit" as a page-rounded LONG_MAX


def _walk_limit(root: Path, rel: str, name: str) -> int | None:
    limit = None
    path = root / rel.lstrip("/")
    while True:
        try:
            text = (path / name).read_text().strip()
            if text != "max" and int(text) < _UNLIMITED_V1:
                limit = int(text) if limit is None else min(limit, int(text))
        except (OSError, ValueError):
            pass
        if path == root or root not in path.parents:
            return limit
        path = path.parent


def machine_memory() -> tuple[int, int, str]:
    """(total, usable, source) for this process."""
    if mx.metal.is_available():
        info = mx.device_info()
        total = int(info.get("memory_size", 0))
        usable = int(info.get("max_recommended_working_set_size", total))
        return total, usable, "Metal recommended working set"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    source = "RAM"
    limit = cgroup_memory_limit()
    if limit is not None and limit < total:
        total, source = limit, "cgroup memory limit"
    return total, int(total * LINUX_USABLE_FRACTION), source


@dataclass(frozen=True)
class ExpertLayout:
    """Per MoE layer: bytes of one expert and number of experts."""

    expert_bytes: list[int]
    num_experts: list[int]

    @property
    def experts_bytes(self) -> int:
        return sum(b * e for b, e in zip(self.expert_bytes, self.num_experts))


def unloaded(name: str) -> bool:
    """A tensor a checkpoint stores that mlx-lm's sanitize drops before loading: a
    vision-language conversion's vision tower (qwen3_5_moe), multi-token-prediction layers. It is
    never in memory, so the plan leaves it out (0.9 GB of Qwen3.6-35B-A3B's ~20 GB)."""
    return name.startswith(("vision_tower.", "model.visual.", "mtp.")) or ".mtp." in name


def resident_bytes(index: CheckpointIndex, layout: ExpertLayout) -> int:
    """The weights that load and stay: all but the routed experts and the unloaded tensors."""
    dropped = sum(loc.nbytes for name, loc in index.tensors.items() if unloaded(name))
    return index.total_bytes - layout.experts_bytes - dropped


def layout_from_index(index: CheckpointIndex) -> ExpertLayout:
    """Find stacked expert tensors by name (used before the model is built)."""
    owners: dict[str, list[int]] = {}
    for name, loc in index.tensors.items():
        m = _EXPERT_TENSOR.match(name)
        if m and len(loc.shape) >= 2:
            owners.setdefault(m.group("owner"), [0, loc.shape[0]])[0] += loc.expert_stride
    ordered = sorted(owners.items(), key=lambda kv: _natural(kv[0]))
    return ExpertLayout([v[0] for _, v in ordered], [v[1] for _, v in ordered])


def _natural(name: str) -> list[int | str]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def default_working_bytes(resident_bytes: int) -> int:
    # Activations, logits and MLX's buffer cache; pass a real estimate for long prompt chunks.
    return max(MIN_WORKING_BYTES, resident_bytes // 8)


def process_rss() -> int:
    try:
        return int(psutil.Process().memory_info().rss)
    except (psutil.Error, OSError):  # no /proc to read: plan without a baseline
        return 0


# The prefix cache's memory tier at `prefix_cache_bytes = "auto"`: a small share of what the plan
# may use (a long agent conversation's KV cache), never more than the cap.
PREFIX_AUTO_SHARE = 0.04
PREFIX_AUTO_CAP = 2 * 10**9


def auto_prefix_cache_bytes(usable_memory: int) -> int:
    return int(min(PREFIX_AUTO_CAP, PREFIX_AUTO_SHARE * usable_memory))


def lane_bytes(slots: list[int], layout: ExpertLayout) -> int:
    """The pass lane's bytes (pass_lane.py): as large as the largest pool of a layer whose experts
    do not all fit its slots; 0 where every layer holds all of its experts."""
    pools = [s * b for s, b, e in zip(slots, layout.expert_bytes, layout.num_experts) if s < e]
    return max(pools, default=0)


def make_plan(
    layout: ExpertLayout,
    resident_bytes: int,
    cache_budget: CacheBudget | str | int,
    *,
    kv_bytes: int = 0,
    working_bytes: int = 0,
    baseline_bytes: int | None = None,
    memory: tuple[int, int, str] | None = None,
    prefix_cache_bytes: int | None = 0,
    pass_lane: bool = True,
) -> MemoryPlan:
    """`baseline_bytes` None: this process's RSS now (call before materializing weights);
    `prefix_cache_bytes` None: the automatic share of usable memory; `pass_lane`: the pools
    land reads directly (the streamer then allocates the pass lane beside them)."""
    total, usable, source = memory or machine_memory()
    if prefix_cache_bytes is None:
        prefix_cache_bytes = auto_prefix_cache_bytes(usable)
    working = working_bytes or default_working_bytes(resident_bytes)
    baseline = process_rss() if baseline_bytes is None else baseline_bytes
    experts = layout.experts_bytes
    auto = usable - baseline - resident_bytes - kv_bytes - prefix_cache_bytes - working
    if not isinstance(cache_budget, CacheBudget):  # a StreamingConfig given text (bench, tests)
        cache_budget = CacheBudget.parse(cache_budget)
    per_slot = sum(layout.expert_bytes)
    if pass_lane and per_slot:  # an automatic budget leaves the lane its room: one more slot each
        auto = auto * per_slot // (per_slot + max(layout.expert_bytes))
    budget = cache_budget.resolve(experts, auto_bytes=max(0, auto))
    slots = (
        slots_per_layer(budget, layout.expert_bytes, layout.num_experts)
        if layout.num_experts
        else [0]
    )
    allocated = sum(s * b for s, b in zip(slots, layout.expert_bytes))
    return MemoryPlan(
        total_memory=total,
        usable_memory=usable,
        memory_source=source,
        resident_bytes=resident_bytes,
        experts_bytes=experts,
        cache_budget_bytes=allocated,
        kv_bytes=kv_bytes,
        working_bytes=working,
        baseline_bytes=baseline,
        num_layers=len(layout.num_experts),
        slots_per_layer=min(slots) if slots else 0,
        num_experts=max(layout.num_experts) if layout.num_experts else 0,
        prefix_cache_bytes=prefix_cache_bytes,
        lane_bytes=lane_bytes(slots, layout) if pass_lane and layout.num_experts else 0,
    )


def plan_memory(
    model_path: Path,
    cfg: StreamingConfig,
    *,
    kv_bytes: int = 0,
    working_bytes: int = 0,
    baseline_bytes: int | None = None,
    memory: tuple[int, int, str] | None = None,
) -> MemoryPlan:
    """Plan from the checkpoint alone (before loading). `cfg` is a StreamingConfig."""
    index = CheckpointIndex(Path(model_path))
    layout = layout_from_index(index)
    resident = resident_bytes(index, layout)
    return make_plan(
        layout,
        resident,
        cfg.cache_budget,
        kv_bytes=kv_bytes or cfg.kv_bytes,
        working_bytes=working_bytes or cfg.working_bytes,
        baseline_bytes=baseline_bytes,
        memory=memory or _memory_override(cfg),
        prefix_cache_bytes=getattr(cfg, "prefix_cache_bytes", 0),
        pass_lane=Landing(cfg.landing).resolve(on_cuda()) is Landing.DIRECT,
    )


def _memory_override(cfg: StreamingConfig) -> tuple[int, int, str] | None:
    if getattr(cfg, "memory_bytes", 0):
        n = int(cfg.memory_bytes)
        return n, n, "configured"
    return None


def estimate_kv_bytes(config: ModelConfig, tokens: int, dtype_bytes: int = 2) -> int:
    """Upper bound of a full-attention KV cache for `tokens` tokens (hybrid models use less)."""
    cfg = config.text
    layers = config.num_layers or 0
    heads = int(cfg.get("num_key_value_heads") or cfg.get("num_attention_heads", 0))
    head_dim = int(
        cfg.get("head_dim")
        or (cfg.get("hidden_size", 0) // max(1, cfg.get("num_attention_heads", 1)))
    )
    return 2 * layers * heads * head_dim * tokens * dtype_bytes
