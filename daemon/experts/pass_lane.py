"""The pass lane: one more set of slot arrays, as wide as a layer's pool, shared by every layer.

A call needing more experts than its layer has slots (a prompt chunk) runs several passes. In one
pool they are serial: pass p+1's reads overwrite slots pass p computes from, so they wait for it
(the fence), and the device waits for them. With the lane, passes alternate between the pool and
the lane: pass p+1 is read into the set pass p does not use while pass p computes, and only waits
for pass p-1, submitted before it. Experts read into the lane are not cached (the pool keeps what
its policy admits); each is read once per call, as without the lane. One layer's pool of memory
(the memory plan's `lane_bytes`), and only with the DIRECT landing: a STAGED pool's landing makes
a new version of it, so its passes never wait for each other anyway.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from moed.daemon.experts.cache import LayerPool, PooledTensor, alloc_slots
from moed.daemon.experts.landing import Staging

LANE = -1  # the lane's key in the fence (a layer's pool is keyed by its index)


class PassLane:
    def __init__(self, like: LayerPool):
        """Arrays of `like`'s shapes and dtypes, one slot per slot of `like`'s pool."""
        self.slots = like.slots
        self._shapes = _shapes(like.tensors)
        # Allocated as a DIRECT pool is (host-filled, viewed as bytes by the read workers).
        self.arrays: dict[str, mx.array] = {
            t.key: alloc_slots(t.loc, self.slots) for t in like.tensors
        }
        # mx.array exports the buffer protocol; its stubs declare no __buffer__.
        self.views = {
            k: memoryview(a).cast("B")  # type: ignore[arg-type]
            for k, a in self.arrays.items()
        }

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def fits(self, pool: LayerPool) -> bool:
        """Whether `pool`'s passes can use the lane: same tensors, no more slots per pass."""
        return (
            not pool.staged and pool.slots <= self.slots and _shapes(pool.tensors) == self._shapes
        )

    def target(self, pool: LayerPool) -> LaneTarget:
        return LaneTarget(self, pool.tensors)


class LaneTarget:
    """What the store's read jobs need (store.py `jobs_for`): the layer's tensors (where the
    bytes are in the checkpoint) and where load i lands (lane slot `loads[i][1]`)."""

    def __init__(self, lane: PassLane, tensors: list[PooledTensor]):
        self.lane = lane
        self.tensors = tensors

    def destinations(self, staging: Staging, tensor: PooledTensor) -> list[memoryview]:
        n, view = tensor.slot_bytes, self.lane.views[tensor.key]
        return [view[slot * n : (slot + 1) * n] for _e, slot in staging.loads]


def lane_loads(experts: Sequence[int]) -> list[tuple[int, int]]:
    """A lane pass's (expert, slot) loads: experts in order, slot i for the i-th."""
    return [(int(e), i) for i, e in enumerate(experts)]


def _shapes(tensors: list[PooledTensor]) -> dict[str, tuple[tuple[int, ...], str]]:
    return {t.key: (tuple(t.loc.shape[1:]), t.loc.dtype) for t in tensors}
