"""Install streaming into a lazily loaded mlx-lm model and run the expert cache behind it."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear, SwitchMLP

from moed.daemon.config import PageCachePolicy
from moed.daemon.experts import profile as profile_mod
from moed.daemon.experts.cache import LayerPool, LRUPolicy, PolicyFactory, PooledTensor, mlx_dtype
from moed.daemon.experts.counters import Counters, LayerCounters
from moed.daemon.experts.memory_plan import (
    ExpertLayout,
    MemoryPlan,
    _memory_override,
    _natural,
    make_plan,
)
from moed.daemon.experts.prefetch import ReadPool
from moed.daemon.experts.safetensors_index import CheckpointError, CheckpointIndex, TensorLoc
from moed.daemon.experts.store import ExpertStore, resolve_page_cache
from moed.daemon.experts.streaming_switch import ProjSpec, StreamingSwitch

log = logging.getLogger(__name__)

_PARAMS = ("weight", "scales", "biases", "bias", "global_scale")
_GLU_PROJS = ("gate_proj", "up_proj", "down_proj")
_MLP_PROJS = ("fc1", "fc2")


@dataclass(frozen=True)
class StreamingConfig:
    cache_budget: str | int = "auto"  # bytes, "12GB", "25%", "0.25" or "auto"
    prefetch_workers: int = 0  # 0: sized to the machine
    page_cache: PageCachePolicy = PageCachePolicy.AUTO
    state_dir: Path | None = None  # where the usage profile lives; None: no profile
    memory_bytes: int = 0  # 0: detect (RAM, cgroup limit, Metal working set)
    kv_bytes: int = 0  # KV cache estimate the auto budget leaves room for
    working_bytes: int = 0  # 0: default estimate
    # Speculative: while layer L computes, read the experts layer L+1's router picks for layer L's
    # input. Exact either way (it only changes what is resident); costs bandwidth when wrong.
    prefetch_next: bool = False


@dataclass(frozen=True)
class _Switch:
    path: str  # module path, e.g. "model.layers.3.mlp.switch_mlp"
    kind: str
    module: nn.Module
    projs: dict[str, ProjSpec]
    tensors: list[PooledTensor]
    num_experts: int
    router: nn.Module | None = None  # the sibling gate that routes to this switch


def find_switches(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every SwitchGLU / SwitchMLP, in depth order (named_modules lists them last layer first)."""
    found = [
        (name, m) for name, m in model.named_modules() if isinstance(m, (SwitchGLU, SwitchMLP))
    ]
    return sorted(found, key=lambda nm: _natural(nm[0]))


def _proj_spec(name: str, lin: nn.Module) -> tuple[ProjSpec, dict[str, mx.array]]:
    arrays = {p: lin[p] for p in _PARAMS if p in lin and isinstance(lin[p], mx.array)}
    if isinstance(lin, QuantizedSwitchLinear):
        spec = ProjSpec(
            name,
            True,
            lin.group_size,
            lin.bits,
            lin.mode,
            has_biases="biases" in arrays,
            has_bias="bias" in arrays,
            has_global_scale="global_scale" in arrays,
        )
    elif isinstance(lin, SwitchLinear):
        spec = ProjSpec(name, False, has_bias="bias" in arrays)
    else:
        raise CheckpointError(f"unsupported expert projection {name}: {type(lin).__name__}")
    return spec, arrays


def _resolve(
    model: nn.Module, index: CheckpointIndex, wanted: dict[str, mx.array]
) -> dict[str, TensorLoc]:
    """Map model parameter paths to tensors on disk. Names usually match; when the model's
    sanitize renames keys (e.g. qwen3_5_moe's language_model prefix), follow the renaming by
    identity of the lazily loaded arrays; as a last resort match the `layers.N...` suffix."""
    found = {p: index[p] for p in wanted if p in index}
    missing = [p for p in wanted if p not in found]
    if missing and hasattr(model, "sanitize"):
        loaded: dict[str, mx.array] = {}
        for f in index.files:
            loaded.update(mx.load(str(f)))  # lazy: nothing is read
        by_id = {id(v): k for k, v in loaded.items()}
        try:
            sanitized = model.sanitize(dict(loaded))
        except Exception as exc:  # noqa: BLE001 - a failing sanitize only loses this strategy
            log.debug("sanitize probe failed: %s", exc)
            sanitized = {}
        for p in missing:
            v = sanitized.get(p)
            if v is not None and id(v) in by_id:
                found[p] = index[by_id[id(v)]]
        del loaded, sanitized, by_id
        missing = [p for p in wanted if p not in found]
    for p in missing:
        if "layers." not in p:
            continue
        tail = p[p.index("layers.") :]
        cands = [
            loc
            for n, loc in index.tensors.items()
            if (n == tail or n.endswith("." + tail)) and loc.shape == tuple(wanted[p].shape)
        ]
        if len(cands) == 1:
            found[p] = cands[0]
    for p, arr in wanted.items():
        loc = found.get(p)
        if loc is None:
            raise CheckpointError(
                f"expert tensor {p} is not stored as-is in {index.model_path} "
                "(a sanitize step transforms it); "
                "convert the checkpoint with mlx_lm.convert first"
            )
        if loc.shape != tuple(arr.shape) or mlx_dtype(loc.dtype) != arr.dtype:
            raise CheckpointError(
                f"expert tensor {p}: {loc.name} on disk is {loc.dtype}{list(loc.shape)}, "
                f"the model expects {arr.dtype}{list(arr.shape)}"
            )
    return found


def _describe_switches(model: nn.Module, index: CheckpointIndex) -> list[_Switch]:
    found = find_switches(model)
    if not found:
        raise CheckpointError("the model has no SwitchGLU / SwitchMLP layers: nothing to stream")
    specs, wanted = [], {}
    for path, m in found:
        kind = "glu" if isinstance(m, SwitchGLU) else "mlp"
        projs, arrays = {}, {}
        for name in _GLU_PROJS if kind == "glu" else _MLP_PROJS:
            spec, arrs = _proj_spec(name, m[name])
            projs[name] = spec
            for p, a in arrs.items():
                arrays[(name, p)] = a
                wanted[f"{path}.{name}.{p}"] = a
        specs.append((path, kind, m, projs, arrays))
    locs = _resolve(model, index, wanted)
    out = []
    for path, kind, m, projs, arrays in specs:
        tensors = [PooledTensor(name, p, locs[f"{path}.{name}.{p}"]) for (name, p) in arrays]
        num = {t.loc.shape[0] for t in tensors}
        if len(num) != 1:
            raise CheckpointError(
                f"{path}: expert tensors disagree on the number of experts {sorted(num)}"
            )
        n = num.pop()
        out.append(_Switch(path, kind, m, projs, tensors, n, _find_router(model, path, m, n)))
    return out


def _find_router(
    model: nn.Module, path: str, switch: nn.Module, num_experts: int
) -> nn.Module | None:
    """The switch's sibling whose weight maps the hidden state to one logit per expert (`gate`,
    `router`, DeepSeek's MoEGate); None when there is no single such module."""
    parent: Any = model
    for part in path.split(".")[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else getattr(parent, part)
    found = []
    for _name, child in parent.children().items():
        if child is switch or not isinstance(child, nn.Module):
            continue
        weight = child.get("weight") if hasattr(child, "get") else None
        if isinstance(weight, mx.array) and weight.ndim == 2 and weight.shape[0] == num_experts:
            found.append(child)
    return found[0] if len(found) == 1 else None


def _set_module(model: nn.Module, path: str, new: nn.Module) -> None:
    parts = path.split(".")
    parent: Any = model
    for part in parts[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else getattr(parent, part)
    last = parts[-1]
    if isinstance(parent, list):
        parent[int(last)] = new
    else:
        setattr(parent, last, new)


class ExpertStreamer:
    """Owns the slot pools, the store, the read workers, the counters and the usage profile."""

    def __init__(
        self,
        model_path: Path,
        cfg: StreamingConfig,
        index: CheckpointIndex,
        switches: list[_Switch],
        policy_factory: PolicyFactory = lambda layer, n: LRUPolicy(n),
    ):
        self.model_path = Path(model_path)
        self.cfg = cfg
        self.index = index
        self.paths = [s.path for s in switches]
        self.layout = ExpertLayout(
            [sum(t.slot_bytes for t in s.tensors) for s in switches],
            [s.num_experts for s in switches],
        )
        self.resident_weight_bytes = index.total_bytes - self.layout.experts_bytes
        self.plan = make_plan(
            self.layout,
            self.resident_weight_bytes,
            cfg.cache_budget,
            kv_bytes=cfg.kv_bytes,
            working_bytes=cfg.working_bytes,
            memory=_memory_override(cfg),
        )
        self.baseline_bytes = self.plan.baseline_bytes  # measured before weights and pools exist
        self.budget_bytes = self.plan.cache_budget_bytes
        slots = self.plan.slots_per_layer
        self.pools = [
            LayerPool(
                i,
                s.tensors,
                s.num_experts,
                min(slots, s.num_experts),
                policy_factory(i, s.num_experts),
            )
            for i, s in enumerate(switches)
        ]
        self.bypass_page_cache = resolve_page_cache(
            cfg.page_cache, self.layout.experts_bytes, self.plan.total_memory
        )
        self.store = ExpertStore(index.files, self.bypass_page_cache)
        self.reader = ReadPool(self.store, cfg.prefetch_workers)
        self.counters = Counters(layers=[LayerCounters() for _ in switches])
        self.usage = [np.zeros(s.num_experts, dtype=np.int64) for s in switches]
        self.routers = [s.router for s in switches]
        self._predicted: tuple[int, np.ndarray] | None = None  # (layer, experts) to prefetch next
        self._inflight: dict[int, tuple[list, list[tuple[int, int]], set[int]]] = {}
        self._pending_slots: int | None = None  # a shed requested from another thread
        self._engine_thread = threading.get_ident()  # the loading thread until the first layer call
        self._lock = threading.Lock()
        self.trace: list[list[np.ndarray]] | None = None  # set to [] to record routing (bench)
        # A router-trace recorder (moed.daemon.telemetry.trace), attached around one request's step.
        self.observer = None

    # -- called by StreamingSwitch on the engine thread -------------------------------------

    def route(self, layer: int, indices: mx.array, x: mx.array | None = None) -> np.ndarray:
        """Read the router's choices back to the host (the known cost centre, timed)."""
        self._engine_thread = threading.get_ident()
        if layer == 0 and self._pending_slots is not None:
            self._apply_shed()
        c = self.counters
        predicted = self._prediction(layer, indices, x)
        t0 = time.perf_counter()
        mx.eval(indices) if predicted is None else mx.eval(indices, predicted)
        t1 = time.perf_counter()
        host = np.array(indices)
        self._predicted = (
            (layer + 1, np.unique(np.array(predicted))) if predicted is not None else None
        )
        flat = host.reshape(-1)
        self.usage[layer] += np.bincount(flat, minlength=self.usage[layer].shape[0])
        if layer == 0:
            c.tokens += flat.size // max(1, host.shape[-1]) if host.ndim else 1
        if self.trace is not None:
            if layer == 0:
                self.trace.append([])
            if self.trace:
                self.trace[-1].append(np.unique(flat))
        c.layer_calls += 1
        c.router_sync_s += t1 - t0
        c.router_copy_s += time.perf_counter() - t1
        if self.observer is not None:
            self.observer.on_route(layer, host)
        return host

    def _prediction(self, layer: int, indices: mx.array, x: mx.array | None) -> mx.array | None:
        """Layer L+1's router applied to layer L's input (decode steps only: a few tokens)."""
        nxt = layer + 1
        if (
            not self.cfg.prefetch_next
            or x is None
            or nxt >= len(self.pools)
            or self.routers[nxt] is None
        ):
            return None
        k = indices.shape[-1] if indices.ndim else 1
        if indices.size > 4 * k or self.pools[nxt].slots < 2 * k:
            return None  # prefill chunks route widely; tiny caches would only thrash
        out = self.routers[nxt](x)
        if isinstance(out, tuple):  # MoEGate returns (indices, scores)
            return mx.stop_gradient(out[0])
        return mx.argpartition(-out, kth=k - 1, axis=-1)[..., :k]

    def _prefetch(self, layer: int, experts: np.ndarray) -> None:
        """Queue reads of predicted experts of `layer` (its previous computations are evaluated)."""
        pool = self.pools[layer]
        wanted = [int(e) for e in experts if pool.slot_of[e] < 0]
        if not wanted or layer in self._inflight:
            return
        _hits, loads = self._admit(pool, wanted)
        futures = self.reader.submit(self.store.jobs_for(pool, loads))
        self._inflight[layer] = (futures, loads, {e for e, _ in loads})
        self.counters.prefetched += len(loads)

    def _await_prefetch(self, layer: int) -> set[int]:
        """Wait for this layer's speculative reads; returns the experts they brought in."""
        entry = self._inflight.pop(layer, None)
        if entry is None:
            return set()
        futures, loads, experts = entry
        c = self.counters
        t0 = time.perf_counter()
        try:
            res = self.reader.wait(futures)
        except OSError as exc:
            self.pools[layer].forget(loads)  # a demand read will retry and report it
            log.warning("prefetch read failed: %s", exc)
            c.stall_s += time.perf_counter() - t0
            return set()
        self._count_reads(res, len(futures), prefetch=True)
        return experts

    def _drain_prefetch(self) -> None:
        for layer in list(self._inflight):
            self._await_prefetch(layer)

    def plan_passes(self, layer: int, host: np.ndarray) -> list[np.ndarray]:
        needed = np.unique(host)
        pool = self.pools[layer]
        if needed.size <= pool.slots:
            return [needed]
        # Resident experts first: the first pass is all hits as far as it goes.
        resident = pool.slot_of[needed] >= 0
        ordered = np.concatenate([needed[resident], needed[~resident]])
        passes = [ordered[i : i + pool.slots] for i in range(0, ordered.size, pool.slots)]
        self.counters.passes += len(passes) - 1
        return passes

    def load(self, layer: int, experts: np.ndarray) -> tuple[np.ndarray, dict[str, mx.array]]:
        """Make `experts` resident in `layer`; returns (expert -> slot table, pools)."""
        pool = self.pools[layer]
        prefetched = self._await_prefetch(layer)
        hits, loads = self._admit(pool, experts)
        self.counters.prefetch_hits += len(prefetched.intersection(int(e) for e in experts))
        lc = self.counters.layers[layer]
        lc.hits += len(hits)
        lc.misses += len(loads)
        if self.observer is not None:  # before the read: it asks whether the pages are cached
            self.observer.on_load(layer, pool, hits, loads)
        demand = self.reader.submit(self.store.jobs_for(pool, loads)) if loads else []
        if self._predicted is not None and self._predicted[0] == layer + 1:
            self._prefetch(layer + 1, self._predicted[1])  # queued behind this layer's misses
            self._predicted = None
        if demand:
            self._collect(pool, loads, demand)
        table = np.zeros(pool.num_experts, dtype=np.uint32)
        table[experts] = pool.slot_of[experts]
        return table, pool.arrays

    def finish(self, out: mx.array) -> None:
        t0 = time.perf_counter()
        mx.eval(out)
        self.counters.expert_compute_s += time.perf_counter() - t0

    def _collect(self, pool: LayerPool, loads: list[tuple[int, int]], futures: list) -> None:
        try:
            res = self.reader.wait(futures)
        except BaseException:
            pool.forget(loads)
            raise
        self._count_reads(res, len(futures))

    def _admit(self, pool: LayerPool, experts) -> tuple[list[int], list[tuple[int, int]]]:
        free_before = pool.free_slots
        hits, loads = pool.admit(experts)
        self.counters.evictions += max(
            0, len(loads) - free_before
        )  # loads beyond free slots evicted
        return hits, loads

    def _count_reads(self, res, jobs: int, prefetch: bool = False) -> None:
        """Account reads the engine waited for (demand misses, or speculative reads it caught up
        with)."""
        c = self.counters
        c.reads += jobs
        c.read_s += res.read_s
        c.stall_s += res.wall_s
        if prefetch:
            c.prefetch_bytes += res.bytes_read
        else:
            c.bytes_read += res.bytes_read

    # -- public API ------------------------------------------------------------------------

    @property
    def slots(self) -> list[int]:
        return [p.slots for p in self.pools]

    @property
    def resident_bytes(self) -> int:
        return sum(p.pool_bytes for p in self.pools)

    def snapshot(self) -> dict:
        snap = self.counters.snapshot()
        snap.update(
            {
                "resident_bytes": self.resident_bytes,
                "budget_bytes": self.budget_bytes,
                "resident_weight_bytes": self.resident_weight_bytes,
                "experts_bytes": self.layout.experts_bytes,
                "expert_bytes": self.layout.expert_bytes[0] if self.layout.expert_bytes else 0,
                "num_layers": len(self.pools),
                "num_experts": self.layout.num_experts[0] if self.layout.num_experts else 0,
                "slots_per_layer": self.slots,
                # Every slot is free or holds one expert: no walk over the slot tables needed.
                "cached_experts": sum(p.slots - p.free_slots for p in self.pools),
                "prefetch_workers": self.reader.workers,
                "page_cache_bypass": self.bypass_page_cache,
            }
        )
        return snap

    def memory_plan(
        self, kv_bytes: int | None = None, working_bytes: int | None = None
    ) -> MemoryPlan:
        """The plan for the slots actually allocated, with a new KV / working estimate."""
        budget = self.resident_bytes
        return make_plan(
            self.layout,
            self.resident_weight_bytes,
            budget,
            kv_bytes=self.cfg.kv_bytes if kv_bytes is None else kv_bytes,
            working_bytes=(working_bytes or self.cfg.working_bytes),
            baseline_bytes=self.baseline_bytes,
            memory=_memory_override(self.cfg),
        )

    def shed(self, fraction: float) -> int:
        """Shrink the cache to `fraction` of its current size (at least one slot per layer).
        Returns the bytes released. From another thread the change is applied at the start of the
        next token, on the engine thread (the pools are MLX arrays)."""
        if not 0.0 <= fraction < 1.0:
            raise ValueError("shed fraction must be in [0, 1)")
        with self._lock:
            current = self._pending_slots if self._pending_slots is not None else min(self.slots)
            target = max(1, int(current * fraction))
            released = sum(
                (p.slots - min(target, p.num_experts)) * p.expert_bytes
                for p in self.pools
                if p.slots > target
            )
            self._pending_slots = target
        if self._engine_thread == threading.get_ident():
            self._apply_shed()
        return released

    def _apply_shed(self) -> None:
        self._drain_prefetch()
        with self._lock:
            target, self._pending_slots = self._pending_slots, None
        if target is None:
            return
        released = sum(p.resize(min(p.slots, target)) for p in self.pools)
        self.budget_bytes = self.resident_bytes
        mx.clear_cache()  # hand the freed pool buffers back to the OS
        log.info("expert cache shed to %d slots per layer (%d bytes released)", target, released)

    @property
    def profile_path(self) -> Path | None:
        if self.cfg.state_dir is None:
            return None
        return profile_mod.profile_path(self.cfg.state_dir, self.model_path)

    def save_profile(self) -> Path | None:
        """Merge this run's usage into the saved profile (atomic write). Returns its path."""
        path = self.profile_path
        if path is None:
            return None
        saved = profile_mod.load_profile(path, self.layout.num_experts)
        profile_mod.save_profile(path, self.model_path, profile_mod.merge(saved, self.usage))
        return path

    def warm(self) -> int:
        """Preload each layer's most used experts from the saved profile. Returns bytes read."""
        path = self.profile_path
        counts = profile_mod.load_profile(path, self.layout.num_experts) if path else None
        if counts is None:
            return 0
        chosen = []
        for pool, layer_counts in zip(self.pools, counts):
            used = np.flatnonzero(layer_counts)
            top = used[np.argsort(-layer_counts[used], kind="stable")][: pool.slots]
            # Least used first, so the LRU order keeps the most used longest.
            chosen.append(sorted(top.tolist(), key=lambda e: layer_counts[e]))
        return self.preload(chosen)

    def preload(self, experts_by_layer: list[list[int]]) -> int:
        """Load these experts of each layer (at most `slots`; the last listed are kept longest),
        all layers' reads in one parallel batch. Returns bytes read (counted as warm_bytes)."""
        self._drain_prefetch()
        jobs, admitted = [], []
        for pool, experts in zip(self.pools, experts_by_layer):
            experts = [int(e) for e in experts][-pool.slots :]
            if not experts:
                continue
            _hits, loads = pool.admit(experts)
            if loads:
                admitted.append((pool, loads))
                jobs += self.store.jobs_for(pool, loads)
        try:
            res = self.reader.read(jobs)
        except BaseException:
            for pool, loads in admitted:
                pool.forget(loads)
            raise
        c = self.counters
        c.reads += len(jobs)
        c.read_s += res.read_s
        c.warm_bytes += res.bytes_read
        c.warm_s += res.wall_s
        return res.bytes_read

    def close(self) -> None:
        try:
            self._drain_prefetch()
        finally:
            self.reader.close()
        self.store.close()


def install_streaming(
    model: nn.Module,
    model_path: Path,
    cfg: StreamingConfig | None = None,
    policy_factory: PolicyFactory | None = None,
) -> ExpertStreamer:
    """Replace every SwitchGLU / SwitchMLP of a lazily loaded mlx-lm model with a streaming twin.
    Call before `mx.eval(model.parameters())`, which then materializes only non-expert weights."""
    cfg = cfg or StreamingConfig()
    index = CheckpointIndex(Path(model_path))
    switches = _describe_switches(model, index)
    kwargs = {"policy_factory": policy_factory} if policy_factory else {}
    streamer = ExpertStreamer(Path(model_path), cfg, index, switches, **kwargs)
    for layer, sw in enumerate(switches):
        twin = StreamingSwitch(sw.kind, sw.projs, sw.module.activation, layer, streamer)
        _set_module(model, sw.path, twin)
    log.info(
        "streaming %d MoE layers, %d slots per layer\n%s",
        len(switches),
        min(streamer.slots),
        streamer.plan.describe(),
    )
    return streamer
