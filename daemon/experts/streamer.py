"""The expert cache behind the streaming layers: it owns the slot pools, the store, the read
workers, the counters and the usage profile, and starts each layer call and step. Its concerns
live beside it: the routing read-back and the decode call (host_route.py), loads (loads.py),
passes (passes.py), shedding (shedding.py), the profile and preloads (warm.py), speculative
prefetch (speculation.py). `install.py` puts it into a model."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from moed.daemon.experts.budget import CacheBudget
from moed.daemon.experts.cache import LayerPool
from moed.daemon.experts.counters import Counters, LayerCounters
from moed.daemon.experts.cuda_memory import on_cuda, on_gpu
from moed.daemon.experts.discover import SwitchInfo
from moed.daemon.experts.fence import LazyFence
from moed.daemon.experts.held import DeviceTally
from moed.daemon.experts.hooks import EngineHooks, RouteObserver, Watchers
from moed.daemon.experts.host_route import HostRouting
from moed.daemon.experts.landing import Landing
from moed.daemon.experts.loads import SlotLoads
from moed.daemon.experts.memory_plan import (
    ExpertLayout,
    MemoryPlan,
    _memory_override,
    make_plan,
    resident_bytes,
)
from moed.daemon.experts.passes import PassLoads
from moed.daemon.experts.policies import DEFAULT_POLICY, make_policy
from moed.daemon.experts.prefetch import ReadPool
from moed.daemon.experts.prompt_end import PromptEnd
from moed.daemon.experts.safetensors_index import CheckpointIndex
from moed.daemon.experts.shedding import Shedding
from moed.daemon.experts.speculation import Speculator
from moed.daemon.experts.store import ExpertStore, PageCachePolicy, resolve_page_cache
from moed.daemon.experts.tuning import StepTuner, Switch
from moed.daemon.experts.unused_output import UnusedOutput
from moed.daemon.experts.warm import CacheWarmth

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamingConfig:
    # parsed (CacheBudget) by the daemon's configuration; text from bench and tests: bytes, "12GB",
    # "25%", "0.25" or "auto"
    cache_budget: CacheBudget | str | int = "auto"
    prefetch_workers: int = 0  # 0: sized to the machine
    page_cache: PageCachePolicy = PageCachePolicy.AUTO
    state_dir: Path | None = None  # where the usage profile lives; None: no profile
    memory_bytes: int = 0  # 0: detect (RAM, cgroup limit, Metal working set)
    kv_bytes: int = 0  # KV cache estimate the auto budget leaves room for
    # The prefix cache's memory tier, planned beside the KV cache; None: the plan's automatic share.
    prefix_cache_bytes: int | None = 0
    working_bytes: int = 0  # 0: default estimate
    # Speculative: while layer L computes, read the experts layer L+1's router picks for layer L's
    # input. Exact either way (it only changes what is resident); costs bandwidth when wrong.
    prefetch_next: bool = False
    cache_policy: str = DEFAULT_POLICY  # a name in experts/policies (the registry)
    landing: Landing = Landing.AUTO  # where reads land (landing.py): STAGED on CUDA, else DIRECT
    # Submit each host-routed layer's output to the device once built (mx.async_eval), so the
    # device computes it while the host builds the graph up to the next router's read-back
    # (H200: a read-back's wait 5.3 -> 3.2 ms a token; BENCHMARKS.md, issue 22 fifth session).
    # None: where MLX computes on a GPU; on the CPU it bought nothing and cost host time.
    launch_early: bool | None = None


class ExpertStreamer(HostRouting, PassLoads, SlotLoads, Shedding, CacheWarmth):
    """Owns the slot pools, the store, the read workers, the counters and the usage profile."""

    def __init__(
        self,
        model_path: Path,
        cfg: StreamingConfig,
        index: CheckpointIndex,
        switches: list[SwitchInfo],
        resident_weight_bytes: int | None = None,
    ):
        self.model_path = Path(model_path)
        self.cfg = cfg
        self.index = index
        self.paths = [s.path for s in switches]
        self.layout = ExpertLayout(
            [sum(t.slot_bytes for t in s.tensors) for s in switches],
            [s.num_experts for s in switches],
        )
        # A pipeline rank holds only its own layers' weights and says how many bytes those are.
        if resident_weight_bytes is None:
            resident_weight_bytes = resident_bytes(index, self.layout)
        self.resident_weight_bytes = resident_weight_bytes
        self.landing = Landing(cfg.landing).resolve(on_cuda())
        self.plan = make_plan(
            self.layout,
            self.resident_weight_bytes,
            cfg.cache_budget,
            kv_bytes=cfg.kv_bytes,
            working_bytes=cfg.working_bytes,
            memory=_memory_override(cfg),
            prefix_cache_bytes=cfg.prefix_cache_bytes,
            pass_lane=self.landing is Landing.DIRECT,
        )
        self.baseline_bytes = self.plan.baseline_bytes  # measured before weights and pools exist
        self.budget_bytes = self.plan.cache_budget_bytes
        slots = self.plan.slots_per_layer
        self.launch_early = cfg.launch_early if cfg.launch_early is not None else on_gpu()
        self.pools = []
        for i, s in enumerate(switches):
            n = min(slots, s.num_experts)
            policy = make_policy(cfg.cache_policy, s.num_experts, n)
            self.pools.append(LayerPool(i, s.tensors, s.num_experts, n, policy, self.landing))
        self.lane = self._make_lane()
        self.bypass_page_cache = resolve_page_cache(
            cfg.page_cache, self.layout.experts_bytes, self.plan.total_memory
        )
        self.store = ExpertStore(index.files, self.bypass_page_cache)
        self.reader = ReadPool(self.store, cfg.prefetch_workers)
        self.counters = Counters(layers=[LayerCounters() for _ in switches])
        self.usage = [np.zeros(s.num_experts, dtype=np.int64) for s in switches]  # host-routed
        # Host-routed choices (each call's ids) not yet folded into `usage`: a list append per
        # call, one bincount per layer when usage is asked for (or the list grows long).
        self._routed: list[list[np.ndarray | list[int]]] = [[] for _ in switches]
        # Layers whose every expert is held route on the device (held.py); their usage is here.
        self._held = [False] * len(switches)
        self.tally = DeviceTally([s.num_experts for s in switches])
        self._step_tally: mx.array | None = None  # evaluated with the step's first MoE layer
        self.routers = [s.router for s in switches]
        self.spec = Speculator(self, cfg.prefetch_next)
        # Computing resident experts' rows while the misses are read (streaming_switch.py).
        self.overlap = Switch("overlap_reads")
        self.unused_output = UnusedOutput()  # the engine's prompt chunks (unused_output.py)
        self.prompt_end = PromptEnd(len(switches))  # a prompt's last token (prompt_end.py)
        self.tuner = StepTuner([self.overlap] + ([self.spec.switch] if cfg.prefetch_next else []))
        self._step_layer_s: float | None = None
        self._pending_slots: int | None = None  # a shed requested from another thread
        self.fence = LazyFence(self.counters)  # outputs built, not yet evaluated
        self._engine_thread = threading.get_ident()  # the loading thread until the first layer call
        self._lock = threading.Lock()
        self.trace: list[list[np.ndarray]] | None = None  # routing recorded (record_routing)
        # False: every layer is read back to the host even when it holds every expert (bench).
        self.device_routing = True
        self.watch = Watchers()  # the engine's hooks and a request's observer (hooks.py)

    # -- the door: what the engine, benches and tests hand in (hooks.py) ---------------------

    def attach(self, hooks: EngineHooks) -> None:
        """The engine's hooks, once a model is loaded: its progress beat, its sync points."""
        self.watch.progress = hooks.progress
        self.watch.on_sync = self.fence.on_sync = hooks.on_sync

    @contextmanager
    def observing(self, observer: RouteObserver) -> Iterator[None]:
        """`observer` sees every routing and admission of the passes inside (one traced step)."""
        self.watch.observer = observer
        try:
            yield
        finally:
            self.watch.observer = None

    def record_routing(self, trace: bool = True, device_routing: bool = True) -> None:
        """For benches and tests: `trace` records from now on each forward pass's distinct
        experts per layer (in `trace`; every layer routed on the host); `device_routing` False
        reads a layer back to the host even where it holds every expert."""
        self.trace = [] if trace else None
        self.device_routing = device_routing

    def drop_lane(self) -> None:
        """Multi-pass calls run in the layer's pool alone (benches and tests compare)."""
        self.lane = None

    def hold_tuning(self) -> None:
        """Every tuned switch off, and no more probing (a bench measures one setting)."""
        self.tuner.stop()

    def keep_rows_together(self) -> None:
        """This device's gathers give a row other bits in a smaller call (row_split.py): the
        overlapped decode path, which splits a step's rows, stays off (the tuner, which alone
        turns it on, no longer probes it)."""
        self.overlap.active = False
        self.tuner.remove(self.overlap)
        log.info("this device's expert gathers depend on the call's rows: overlapped reads off")

    # -- called by StreamingSwitch on the engine thread -------------------------------------

    def output_unused(self) -> bool:
        """Whether the last layer may skip this multi-position call (unused_output.py): the
        engine says its output is dropped, and no request's trace records the model's routing
        (a bench's `trace` records what was routed, skipped calls not among them)."""
        if not self.unused_output.active or self.watch.observer is not None:
            return False
        self.unused_output.skipped += 1
        return True

    def begin_call(self, layer: int, indices: mx.array) -> None:
        """Every layer call starts here; the first MoE layer's starts a forward step: count it,
        apply a pending shed, feed the tuner, and tally the previous step's held layers."""
        self._engine_thread = threading.get_ident()
        if layer != 0:
            return
        c = self.counters
        c.steps += 1
        if self._pending_slots is not None:
            self._apply_shed()
        k = indices.shape[-1] if indices.ndim else 1
        rows = indices.size // max(1, k)
        self._begin_step(decode=rows <= 8)
        c.tokens += rows
        self._step_tally = self.tally.step()

    def on_device(self, layer: int) -> bool:
        """Whether this call of `layer` routes on the device: every expert of it is held, and no
        router trace or request recorder needs the choices on the host."""
        if not self._held[layer]:
            pool = self.pools[layer]
            if not pool.whole or self.spec.inflight(layer):
                return False
            pool.hold()  # device arrays in expert order: the router's indices are slots
            self._held[layer] = True
            log.debug("MoE layer %d holds every expert: routed on the device", layer)
        return self.device_routing and self.trace is None and self.watch.observer is None

    def route_on_device(self, layer: int, indices: mx.array) -> mx.array | None:
        """A held layer's call: its bookkeeping without the host. Returns an array the layer's
        output must depend on (the previous step's usage tally), or None."""
        self.tally.record(layer, indices)
        c = self.counters
        c.layer_calls += 1
        c.device_routed += 1
        dep, self._step_tally = self._step_tally, None
        return dep

    @contextmanager
    def prompt_end_step(self) -> Iterator[None]:
        """The engine's scope around a step that reads prompts' last tokens (mlx_compat.py, use
        11): what the last such step used and no pool holds yet is read ahead, layer by layer
        behind each other, and this step's choices are kept for the next (prompt_end.py)."""
        for layer in range(len(self.pools)):
            self.spec.complete(layer)  # what was read during the chunk: long landed, as a rule
            self._read_ahead(layer)
        with self.prompt_end.scope():
            yield

    def _read_ahead(self, layer: int) -> None:
        # Only reads that wait on the SSD are worth hiding: page-cache copies are quick, and a
        # copy beside the chunk takes a core from it (BENCHMARKS.md, agent turns, tenth session).
        if not self.bypass_page_cache:
            return
        experts = self.prompt_end.experts[layer]
        if experts is not None and not self._held[layer] and self.prompt_end.worthwhile:
            self.prompt_end.read(layer, self.spec.read_ahead(layer, experts, prompt_end=True))

    def _fold_tally(self, evaluated: bool = False) -> None:
        """Held layers' hits into the host counters (no host sync: see DeviceTally.fold)."""
        _usage, hits = self.tally.fold(evaluated)
        for lc, h in zip(self.counters.layers, hits.tolist()):
            lc.device_hits = h

    def _begin_step(self, decode: bool) -> None:
        """A forward step starts: the previous decode step's cost goes to the tuner."""
        now = self.counters.layer_s
        if self._step_layer_s is not None and decode:
            self.tuner.on_step(now - self._step_layer_s)
        self._step_layer_s = now if decode else None
        self.spec.end_step()

    def pools_of(self, layer: int) -> dict[str, mx.array]:
        return self.pools[layer].arrays

    # -- public API ------------------------------------------------------------------------

    @property
    def slots(self) -> list[int]:
        return [p.slots for p in self.pools]

    @property
    def resident_bytes(self) -> int:
        return sum(p.pool_bytes for p in self.pools)

    def snapshot(self) -> dict[str, Any]:
        if threading.get_ident() == self._engine_thread:  # no MLX call from other threads
            self._fold_tally()
        snap = self.counters.snapshot()
        snap.update(
            {
                "resident_bytes": self.resident_bytes,
                "lane_bytes": self.lane.nbytes if self.lane is not None else 0,
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
                "direct_io": bool(self.store.direct),
                "landing": self.landing.value,
                **self.spec.snapshot(),
                "prompt_end_shared": self.prompt_end.shared,
                "overlap_reads_active": self.overlap.active,
                "overlap_net_ms_per_step": self.overlap.net_ms,
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
            prefix_cache_bytes=self.cfg.prefix_cache_bytes,
            pass_lane=self.landing is Landing.DIRECT,
        )

    def close(self) -> None:
        try:
            self.spec.drain()
        finally:
            self.reader.close()
        self.store.close()
