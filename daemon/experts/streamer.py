"""The expert cache behind the streaming layers: a small facade that owns the slot pools, the store
and the read workers, plans the memory, and starts each layer call and step. Each concern is an
object of its own, composed here: the routing and its tallies (host_route.py), the loads and
speculative reads (loads.py, speculation.py), the passes and the pass lane (passes.py), shedding
(shedding.py), the profile and preloads (warm.py). What comes from outside experts/ comes through
the door below (hooks.py). `install.py` puts it into a model."""

from __future__ import annotations

import logging
import threading
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
from moed.daemon.experts.hooks import EngineHooks, StepScopes, Watchers
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
from moed.daemon.experts.pass_lane import PassLane
from moed.daemon.experts.passes import PassLoads
from moed.daemon.experts.policies import make_policy
from moed.daemon.experts.prefetch import ReadPool
from moed.daemon.experts.safetensors_index import CheckpointIndex
from moed.daemon.experts.shedding import Shedding
from moed.daemon.experts.store import ExpertStore, resolve_page_cache
from moed.daemon.experts.streaming_config import StreamingConfig
from moed.daemon.experts.tuning import StepTuner, Switch
from moed.daemon.experts.warm import CacheWarmth

log = logging.getLogger(__name__)


class ExpertStreamer:
    """Owns the slot pools, the store and the read workers; its concerns do the rest."""

    def __init__(
        self,
        model_path: Path,
        cfg: StreamingConfig,
        index: CheckpointIndex,
        switches: list[SwitchInfo],
        resident_weight_bytes: int | None = None,
    ):
        self.model_path, self.cfg, self.index = Path(model_path), cfg, index
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
        self.plan = self._plan(cfg.cache_budget, cfg.kv_bytes, cfg.working_bytes, None)
        self.baseline_bytes = self.plan.baseline_bytes  # measured before weights and pools exist
        self.launch_early = cfg.launch_early if cfg.launch_early is not None else on_gpu()
        self.pools: list[LayerPool] = []
        for i, s in enumerate(switches):
            n = min(self.plan.slots_per_layer, s.num_experts)
            policy = make_policy(cfg.cache_policy, s.num_experts, n)
            self.pools.append(LayerPool(i, s.tensors, s.num_experts, n, policy, self.landing))
        self.bypass_page_cache = resolve_page_cache(
            cfg.page_cache, self.layout.experts_bytes, self.plan.total_memory
        )
        self.store = ExpertStore(index.files, self.bypass_page_cache)
        self.reader = ReadPool(self.store, cfg.prefetch_workers)
        self.counters = Counters(layers=[LayerCounters() for _ in switches])
        self.fence = LazyFence(self.counters)  # outputs built, not yet evaluated
        self.watch = Watchers()  # the engine's hooks and a request's observer (hooks.py)
        # Computing resident experts' rows while the misses are read (streaming_switch.py).
        self.overlap = Switch("overlap_reads")
        routers = [s.router for s in switches]
        self.loads = SlotLoads(
            self.pools, self.counters, self.fence, self.reader, self.store, self.watch,
            self.overlap, routers, cfg.prefetch_next, cfg.lookahead,
        )  # fmt: skip
        self.spec = self.loads.spec
        self.passes = PassLoads(self.loads)
        self.routing = HostRouting(self.loads, self.bypass_page_cache)
        self.shedding = Shedding(self.passes, self.routing, self.plan.cache_budget_bytes)
        self.warmth = CacheWarmth(
            cfg.state_dir, self.model_path, self.layout, self.loads, self.routing.usage_counts
        )
        self.tuner = StepTuner([self.overlap] + ([self.spec.switch] if cfg.prefetch_next else []))
        self._step_layer_s: float | None = None
        self.unused_output, self.prompt_end = self.routing.unused_output, self.routing.prompt_end
        # The streaming layers' calls (streaming_switch.py LayerCache), each answered by the
        # concern that owns it: bound once here, so the hot path makes no forwarding call.
        routing, loads, passes, watch = self.routing, self.loads, self.passes, self.watch
        self.output_unused, self.on_device = routing.output_unused, routing.on_device
        self.route_on_device, self.route = routing.route_on_device, routing.route
        self.decode_call, self.load = routing.decode_call, loads.load
        self.begin_load, self.finish_load = loads.begin_load, loads.finish_load
        self.defer = loads.defer
        self.plan_passes, self.load_passes = passes.plan_passes, passes.load_passes
        self.submit_pass, self.lane_layers = passes.submit_pass, passes.lane_layers
        # The door (hooks.py): the scopes the engine enters around a step; for benches and
        # tests, routing recorded, the pass lane dropped, the tuner held.
        self.steps = StepScopes(
            routing.unused_output.scope, routing.prompt_end_step, watch.observing
        )
        self.record_routing, self.drop_lane = routing.record_routing, passes.drop_lane
        self.hold_tuning = self.tuner.stop
        # The rest of the public API, from its concerns.
        self.shed, self.start_over = self.shedding.shed, self.shedding.start_over
        self.usage_counts, self.warm = routing.usage_counts, self.warmth.warm
        self.save_profile, self.preload = self.warmth.save_profile, self.warmth.preload
        self.profile_path = self.warmth.profile_path

    def attach(self, hooks: EngineHooks) -> None:
        """The door (hooks.py): the engine's hooks, once a model is loaded (its progress beat,
        its sync points); what it hands in for a step comes through `steps`."""
        self.watch.progress = hooks.progress
        self.watch.on_sync = self.fence.on_sync = hooks.on_sync

    def keep_rows_together(self) -> None:
        """This device's gathers give a row other bits in a smaller call (row_split.py): the
        overlapped decode path, which splits a step's rows, stays off (the tuner, which alone
        turns it on, no longer probes it)."""
        self.overlap.active = False
        self.tuner.remove(self.overlap)
        log.info("this device's expert gathers depend on the call's rows: overlapped reads off")

    # -- called by StreamingSwitch on the engine thread -------------------------------------

    def begin_call(self, layer: int, indices: mx.array) -> None:
        """Every layer call starts here; the first MoE layer's starts a forward step: count it,
        apply a pending shed, feed the tuner, and tally the previous step's held layers."""
        shedding = self.shedding
        shedding.engine_thread = threading.get_ident()
        if layer != 0:
            return
        c = self.counters
        c.steps += 1
        if shedding.pending is not None:
            shedding.apply()
        k = indices.shape[-1] if indices.ndim else 1
        rows = indices.size // max(1, k)
        # The previous decode step's cost goes to the tuner.
        decode, now = rows <= 8, c.layer_s
        if self._step_layer_s is not None and decode:
            self.tuner.on_step(now - self._step_layer_s)
        self._step_layer_s = now if decode else None
        self.spec.end_step()
        c.tokens += rows
        self.routing.step_started()

    def pools_of(self, layer: int) -> dict[str, mx.array]:
        return self.pools[layer].arrays

    # -- public API ------------------------------------------------------------------------

    @property
    def slots(self) -> list[int]:
        return [p.slots for p in self.pools]

    @property
    def resident_bytes(self) -> int:
        return sum(p.pool_bytes for p in self.pools)

    @property
    def budget_bytes(self) -> int:
        return self.shedding.budget_bytes

    @property
    def lane(self) -> PassLane | None:
        return self.passes.lane

    @property
    def trace(self) -> list[list[np.ndarray]] | None:
        return self.routing.trace

    def snapshot(self) -> dict[str, Any]:
        if threading.get_ident() == self.shedding.engine_thread:  # no MLX call from elsewhere
            self.routing.fold_tally()
        snap = self.counters.snapshot()
        layout, lane = self.layout, self.lane
        snap.update(
            resident_bytes=self.resident_bytes,
            lane_bytes=lane.nbytes if lane is not None else 0,
            budget_bytes=self.budget_bytes,
            resident_weight_bytes=self.resident_weight_bytes,
            experts_bytes=layout.experts_bytes,
            expert_bytes=layout.expert_bytes[0] if layout.expert_bytes else 0,
            num_layers=len(self.pools),
            num_experts=layout.num_experts[0] if layout.num_experts else 0,
            slots_per_layer=self.slots,
            # Every slot is free or holds one expert: no walk over the slot tables needed.
            cached_experts=sum(p.slots - p.free_slots for p in self.pools),
            prefetch_workers=self.reader.workers,
            page_cache_bypass=self.bypass_page_cache,
            direct_io=bool(self.store.direct),
            landing=self.landing.value,
            **self.spec.snapshot(),
            **(look.snapshot() if (look := self.loads.lookahead) is not None else {}),
            prompt_end_shared=self.prompt_end.shared,
            overlap_reads_active=self.overlap.active,
            overlap_net_ms_per_step=self.overlap.net_ms,
        )
        return snap

    def memory_plan(
        self, kv_bytes: int | None = None, working_bytes: int | None = None
    ) -> MemoryPlan:
        """The plan for the slots actually allocated, with a new KV / working estimate."""
        kv = self.cfg.kv_bytes if kv_bytes is None else kv_bytes
        working = working_bytes or self.cfg.working_bytes
        return self._plan(self.resident_bytes, kv, working, self.baseline_bytes)

    def _plan(
        self, budget: CacheBudget | str | int, kv: int, working: int, baseline: int | None
    ) -> MemoryPlan:
        """`baseline` None: measured now (before the weights and pools exist)."""
        return make_plan(
            self.layout,
            self.resident_weight_bytes,
            budget,
            kv_bytes=kv,
            working_bytes=working,
            baseline_bytes=baseline,
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
