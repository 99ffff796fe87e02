"""Per-layer expert slot pools: the slot arrays beside the slot table (slots.py).

Each MoE layer owns one `(slots, ...)` MLX array per expert tensor (gate/up/down weight, scales,
biases, bias) and an expert -> slot table. Reads land directly in a slot through the array's
buffer (an evaluated MLX array is writable in place on the CPU and on unified memory), so a miss
costs one `preadv` and no staging copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from moed.daemon.experts.cuda_memory import on_cuda
from moed.daemon.experts.landing import Landing, Staging
from moed.daemon.experts.policies import EvictionPolicy
from moed.daemon.experts.safetensors_index import CheckpointError, TensorLoc
from moed.daemon.experts.slots import SlotTable
from moed.daemon.experts.staging import DEFAULT_ROWS, StagingRing

# safetensors dtype -> (numpy dtype used to allocate, MLX dtype of the pool)
_DTYPES: dict[str, tuple[type[np.generic], mx.Dtype]] = {
    "F32": (np.float32, mx.float32),
    "F16": (np.float16, mx.float16),
    "BF16": (np.uint16, mx.bfloat16),  # numpy has no bfloat16: allocate as uint16, view as bf16
    "U32": (np.uint32, mx.uint32),
    "I32": (np.int32, mx.int32),
    "U16": (np.uint16, mx.uint16),
    "I16": (np.int16, mx.int16),
    "U8": (np.uint8, mx.uint8),
    "I8": (np.int8, mx.int8),
    "F8_E4M3": (np.uint8, mx.uint8),
    "U64": (np.uint64, mx.uint64),
    "I64": (np.int64, mx.int64),
}


def _pool_dtypes(st_dtype: str) -> tuple[type[np.generic], mx.Dtype]:
    try:
        return _DTYPES[st_dtype]
    except KeyError:
        raise CheckpointError(
            f"expert tensors of dtype {st_dtype} cannot be streamed "
            f"(supported: {', '.join(_DTYPES)})"
        ) from None


def mlx_dtype(st_dtype: str) -> mx.Dtype:
    return _pool_dtypes(st_dtype)[1]


@dataclass(frozen=True)
class PooledTensor:
    """One stacked expert tensor of one layer, e.g. ("gate_proj", "scales")."""

    proj: str
    param: str
    loc: TensorLoc

    @functools.cached_property
    def key(self) -> str:
        return f"{self.proj}.{self.param}"

    @functools.cached_property
    def slot_bytes(self) -> int:
        return self.loc.expert_stride


def alloc_slots(loc: TensorLoc, slots: int) -> mx.array:
    np_dtype, mx_dtype = _pool_dtypes(loc.dtype)
    # Built from numpy so the array owns a dense buffer (mx.zeros may be a broadcast scalar).
    arr = mx.array(np.zeros((slots, *loc.shape[1:]), dtype=np_dtype))
    if arr.dtype != mx_dtype:
        arr = arr.view(mx_dtype)
    mx.eval(arr)
    return arr


def _alloc_on_device(loc: TensorLoc, slots: int) -> mx.array:
    """A pool the device wrote (STAGED landing): a dense copy made by a kernel, never a buffer
    the host filled."""
    arr = mx.contiguous(mx.zeros((slots, *loc.shape[1:]), dtype=_pool_dtypes(loc.dtype)[1]))
    mx.eval(arr)
    return arr


class LayerPool(SlotTable):
    """The slots of one MoE layer: the slot table and policy (slots.py) plus the slot arrays."""

    def __init__(
        self,
        layer: int,
        tensors: list[PooledTensor],
        num_experts: int,
        slots: int,
        policy: EvictionPolicy,
        landing: Landing = Landing.DIRECT,
    ):
        self.layer = layer
        self.tensors = tensors
        self.staged = landing.resolve(on_cuda()) is Landing.STAGED
        self.expert_bytes = sum(t.slot_bytes for t in tensors)
        super().__init__(num_experts, slots, policy)
        self._allocate(slots)
        # A staged pool's reads land in its ring (staging.py), allocated once.
        self.ring = self._make_ring()

    def _make_ring(self) -> StagingRing | None:
        if not self.staged:
            return None
        shapes = {t.key: (t.loc.shape[1:], *_pool_dtypes(t.loc.dtype)) for t in self.tensors}
        return StagingRing(min(DEFAULT_ROWS, self.num_experts), shapes)

    def _allocate(self, slots: int) -> None:
        alloc = _alloc_on_device if self.staged else alloc_slots
        self.arrays: dict[str, mx.array] = {t.key: alloc(t.loc, slots) for t in self.tensors}
        self._new_table()
        # Byte views of each pool; workers write through these (no MLX calls off the engine thread).
        # A staged pool has none: a host view would move a CUDA array back to managed memory.
        self.views: dict[str, memoryview] = (
            {}
            if self.staged
            # mx.array exports the buffer protocol; its stubs declare no __buffer__.
            else {k: memoryview(a).cast("B") for k, a in self.arrays.items()}  # type: ignore[arg-type]
        )

    def _new_table(self) -> None:
        """The expert -> slot table the decode graph reads on the device (streaming_switch.py),
        from `slot_of` (an expert without a slot reads 0: no graph that is evaluated asks for one).
        A DIRECT pool's table is written in place by admissions (`device_slots` views its bytes),
        like its arrays; a staged pool's is made again from `device_slots` when stale."""
        table = np.maximum(self.slot_of, 0).astype(np.uint32)
        if self.staged:
            self.device_slots = table
            self._table: mx.array | None = None
        else:
            self._table = mx.array(table)
            mx.eval(self._table)
            self.device_slots = np.frombuffer(memoryview(self._table), dtype=np.uint32)  # type: ignore[arg-type]
        self._table_given = self.slots_given
        # The layer's decode graph with these arrays and this table built in (streaming_switch.py),
        # for a DIRECT pool, whose arrays and table change only with a new dict and table (reads
        # and admissions write them in place): dropped with them, so it never keeps old arrays
        # alive.
        self.decode_graph: Callable[[mx.array, mx.array], mx.array] | None = None

    def device_table(self) -> mx.array:
        """The expert -> slot table as of now (uint32, on the device)."""
        table = self._table
        if table is None or (self.staged and self._table_given != self.slots_given):  # stale
            assert self.device_slots is not None  # _new_table sets both
            table = self._table = mx.array(self.device_slots)
            self._table_given = self.slots_given
        return table

    @property
    def pool_bytes(self) -> int:
        return self.slots * self.expert_bytes

    def slot_view(self, tensor: PooledTensor, slot: int) -> memoryview:
        n = tensor.slot_bytes
        return self.views[tensor.key][slot * n : (slot + 1) * n]

    def stage(self, loads: list[tuple[int, int]]) -> Staging:
        """Where the reads of `loads` land: host rows for a staged pool (its ring's, or fresh ones
        for a burst the ring cannot hold), else the slots."""
        staging = Staging(sorted(loads))
        if self.ring is not None and not self.ring.take(staging, self.arrays.values()):
            n = len(loads)
            for t in self.tensors:
                shape, np_dtype = (n, *t.loc.shape[1:]), _pool_dtypes(t.loc.dtype)[0]
                staging.buffers[t.key] = np.empty(shape, np_dtype)
        return staging

    def destinations(self, staging: Staging, tensor: PooledTensor) -> list[memoryview]:
        """The bytes each load of `staging` reads `tensor` into (store.py ReadTarget)."""
        if staging.first >= 0:
            ring = self.ring
            assert ring is not None  # only a ring gives rows
            return [ring.view(tensor.key, staging.first + i) for i in range(len(staging.loads))]
        if self.staged:
            return [memoryview(row).cast("B") for row in staging.buffers[tensor.key]]
        n, view = tensor.slot_bytes, self.views[tensor.key]
        return [view[slot * n : (slot + 1) * n] for _e, slot in staging.loads]

    def land(self, staging: Staging) -> None:
        """Reads of a staged pool all finished: one scatter per tensor into a new version of the
        pool (lazy; graphs built before keep the old one)."""
        if not self.staged or staging.landed or not staging.loads:
            return
        staging.landed = True
        slots = mx.array(np.array([slot for _e, slot in staging.loads], dtype=np.int32))
        ring = self.ring if staging.first >= 0 else None
        for t in self.tensors:
            if ring is not None:  # a slice of the ring: the scatter reads the host rows
                rows = ring.rows_of(t.key, staging)
            else:
                rows = mx.array(staging.buffers[t.key])
                dtype = _pool_dtypes(t.loc.dtype)[1]
                if rows.dtype != dtype:
                    rows = rows.view(dtype)
            self.arrays[t.key][slots] = rows
        if ring is not None:
            ring.landed(staging)

    def forget(self, loads: list[tuple[int, int]]) -> None:
        """Loads whose reads failed or were given up (after they ended): their ring rows too."""
        super().forget(loads)
        if self.ring is not None:
            self.ring.abandon(loads)

    @property
    def whole(self) -> bool:
        """Every expert of the layer has a slot and is loaded (no read of it can be pending once
        the caller has collected its loads)."""
        return self.slots == self.num_experts and self.free_slots == 0

    def hold(self) -> None:
        """A whole pool becomes device arrays in expert order (slot e holds expert e), so the
        router's indices are slot indices. The copy is made by the device: on a GPU with managed
        memory, pages the host wrote (every read lands that way) are slower for its kernels than
        pages it wrote itself (an H200 decoded 0.71x resident on host-written pools, 0.93x on
        device copies). New arrays: a graph not yet evaluated keeps reading the old ones."""
        order = mx.array(self.slot_of.astype(np.int32))  # new slot e <- old slot slot_of[e]
        old_views = self.views
        self.arrays = {k: mx.take(a, order, axis=0) for k, a in self.arrays.items()}
        mx.eval(*self.arrays.values())
        if self.ring is not None:  # the copies ran every scatter queued on the old arrays
            self.ring.settle(self.arrays.values())
        for v in old_views.values():
            v.release()
        if not self.staged:
            self.views = {
                k: memoryview(a).cast("B")  # type: ignore[arg-type]  # as in _allocate
                for k, a in self.arrays.items()
            }
        self.slot_of[:] = np.arange(self.num_experts)
        self.slot_list = list(range(self.num_experts))
        self.expert_in[:] = np.arange(self.num_experts)
        self._new_table()  # the identity, for a held layer still read back (bench, traces)

    def start_over(self, slots: int) -> None:
        """Fresh, empty slot arrays of `slots` (a device failure: the failed step may have claimed
        slots it never read, and a staged pool's last scatter may be poisoned); a new ring."""
        for v in self.views.values():
            v.release()
        for expert in self.policy.order():
            self.policy.remove(expert)
        self.policy.set_capacity(slots)
        self._reset(slots)
        self._allocate(slots)
        self.ring = self._make_ring()

    def resize(self, new_slots: int) -> int:
        """Shrink (or grow) the pools, keeping the most valuable residents. Returns bytes
        released."""
        new_slots = max(1, min(int(new_slots), self.num_experts))
        if new_slots == self.slots:
            return 0
        old_bytes = self.pool_bytes
        if self.ring is not None:  # scatters queued on the arrays about to go read its rows
            self.ring.settle(self.arrays.values())
        old_arrays, old_views = self.arrays, self.views
        moves = self.resize_table(new_slots)
        self._allocate(new_slots)
        if self.staged and moves:  # the device moves the kept experts
            src_slots = mx.array(np.array([m[1] for m in moves], dtype=np.int32))
            dst_slots = mx.array(np.array([m[2] for m in moves], dtype=np.int32))
            for k, a in self.arrays.items():
                a[dst_slots] = mx.take(old_arrays[k], src_slots, axis=0)
            mx.eval(*self.arrays.values())
            moves = []
        for _expert, src, dst in moves:
            for t in self.tensors:
                n = t.slot_bytes
                self.views[t.key][dst * n : (dst + 1) * n] = old_views[t.key][
                    src * n : (src + 1) * n
                ]
        for v in old_views.values():
            v.release()
        del old_arrays, old_views
        return max(0, old_bytes - self.pool_bytes)
