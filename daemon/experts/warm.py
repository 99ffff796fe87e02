"""Filling the expert cache ahead of use: each run's usage merged into a saved profile (atomic
write), each layer's most used experts read back at load (`warm`), and any list of experts read
in one parallel batch (`preload`, also `moed bench prewarm`'s)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from moed.daemon.experts import profile as profile_mod
from moed.daemon.experts.cache import LayerPool
from moed.daemon.experts.counters import Counters
from moed.daemon.experts.fence import LazyFence
from moed.daemon.experts.held import DeviceTally
from moed.daemon.experts.memory_plan import ExpertLayout
from moed.daemon.experts.prefetch import ReadPool
from moed.daemon.experts.speculation import Speculator
from moed.daemon.experts.store import ExpertStore

if TYPE_CHECKING:  # types only: the streamer's module imports this one
    from moed.daemon.experts.streamer import StreamingConfig


class CacheWarmth:
    """The streamer's profile and preloading (ExpertStreamer.__init__ sets the state)."""

    # The streamer's state this mixin reads (experts/streamer.py gives each a value).
    cfg: StreamingConfig
    model_path: Path
    layout: ExpertLayout
    pools: list[LayerPool]
    store: ExpertStore
    reader: ReadPool
    spec: Speculator
    fence: LazyFence
    counters: Counters
    usage: list[np.ndarray]
    tally: DeviceTally
    _fold_usage: Callable[[int], None]

    def usage_counts(self) -> list[np.ndarray]:
        """Per layer and expert, the token rows routed to it (host- and device-routed calls).
        On the engine thread: it evaluates the held layers' pending tally."""
        device, _hits = self.tally.settle()
        for layer in range(len(self.usage)):
            self._fold_usage(layer)
        return [u + device[l, : u.shape[0]] for l, u in enumerate(self.usage)]

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
