"""Filling the expert cache ahead of use: each run's usage merged into a saved profile (atomic
write), each layer's most used experts read back at load (`warm`), and any list of experts read
in one parallel batch (`preload`, also `moed bench prewarm`'s)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from moed.daemon.experts import profile as profile_mod
from moed.daemon.experts.loads import SlotLoads
from moed.daemon.experts.memory_plan import ExpertLayout


class CacheWarmth:
    """The streamer's profile and preloading, into the pools of its loads."""

    def __init__(
        self,
        state_dir: Path | None,
        model_path: Path,
        layout: ExpertLayout,
        loads: SlotLoads,
        usage_counts: Callable[[], list[np.ndarray]],
    ) -> None:
        self.model_path, self.layout = model_path, layout
        self.pools, self.store, self.reader = loads.pools, loads.store, loads.reader
        self.spec, self.fence, self.counters = loads.spec, loads.fence, loads.counters
        self.usage_counts = usage_counts  # per layer and expert (host_route.py)
        self.profile_path = (
            None if state_dir is None else profile_mod.profile_path(state_dir, model_path)
        )

    def save_profile(self) -> Path | None:
        """Merge this run's usage into the saved profile (atomic write). Returns its path."""
        path = self.profile_path
        if path is None:
            return None
        saved = profile_mod.load_profile(path, self.layout.num_experts)
        usage = self.usage_counts()
        profile_mod.save_profile(path, self.model_path, profile_mod.merge(saved, usage))
        return path

    def warm(self) -> int:
        """Preload each layer's most used experts from the saved profile. Returns bytes read."""
        path = self.profile_path
        counts = profile_mod.load_profile(path, self.layout.num_experts) if path else None
        if counts is None:
            return 0
        return self.preload(profile_mod.hottest(counts, [p.slots for p in self.pools]))

    def preload(self, experts_by_layer: list[list[int]]) -> int:
        """Load these experts of each layer (at most `slots`; the last listed are kept longest),
        all layers' reads in one parallel batch. Returns bytes read (counted as warm_bytes)."""
        self.spec.drain()
        self.fence.flush()
        jobs, admitted = [], []
        for pool, experts in zip(self.pools, experts_by_layer):
            experts = [int(e) for e in experts][-pool.slots :]
            if not experts:
                continue
            _hits, loads = pool.admit(experts)
            if loads:
                admitted.append((pool, loads, staging := pool.stage(loads)))
                jobs += self.store.jobs_for(pool, staging)
        try:
            res = self.reader.read(jobs)
        except BaseException:
            for pool, loads, _staging in admitted:
                pool.forget(loads)
            raise
        for pool, _loads, staging in admitted:
            pool.land(staging)
        mx.eval(*(a for pool, _l, _s in admitted for a in pool.arrays.values()))
        c = self.counters
        c.reads += len(jobs)
        c.read_s += res.read_s
        c.warm_bytes += res.bytes_read
        c.warm_s += res.wall_s
        return res.bytes_read
