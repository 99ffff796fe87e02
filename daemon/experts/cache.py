"""Per-layer expert slot pools and the eviction policy interface (LRU baseline).

Each MoE layer owns one `(slots, ...)` MLX array per expert tensor (gate/up/down weight, scales,
biases, bias) and an expert -> slot table. Reads land directly in a slot through the array's
buffer (an evaluated MLX array is writable in place on the CPU and on unified memory), so a miss
costs one `preadv` and no staging copy.
"""

from __future__ import annotations

import abc
import functools
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from moed.daemon.experts.safetensors_index import CheckpointError, TensorLoc

# safetensors dtype -> (numpy dtype used to allocate, MLX dtype of the pool)
_DTYPES = {
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


def _pool_dtypes(st_dtype: str) -> tuple:
    try:
        return _DTYPES[st_dtype]
    except KeyError:
        raise CheckpointError(
            f"expert tensors of dtype {st_dtype} cannot be streamed "
            f"(supported: {', '.join(_DTYPES)})"
        ) from None


def mlx_dtype(st_dtype: str):
    return _pool_dtypes(st_dtype)[1]


class EvictionPolicy(abc.ABC):
    """Chooses which resident expert of one layer gives up its slot."""

    @abc.abstractmethod
    def insert(self, expert: int) -> None:
        """`expert` was loaded into a slot."""

    @abc.abstractmethod
    def touch(self, expert: int) -> None:
        """A resident `expert` was used."""

    @abc.abstractmethod
    def remove(self, expert: int) -> None:
        """`expert` left the cache."""

    @abc.abstractmethod
    def victim(self, protected: Container[int]) -> int:
        """A resident expert not in `protected` to evict."""

    @abc.abstractmethod
    def order(self) -> list[int]:
        """Resident experts, most valuable last (used when the cache shrinks)."""


class LRUPolicy(EvictionPolicy):
    def __init__(self, num_experts: int = 0):
        self._order: OrderedDict[int, None] = OrderedDict()

    def insert(self, expert: int) -> None:
        self._order[expert] = None
        self._order.move_to_end(expert)

    def touch(self, expert: int) -> None:
        self._order.move_to_end(expert)

    def remove(self, expert: int) -> None:
        self._order.pop(expert, None)

    def victim(self, protected: Container[int]) -> int:
        for expert in self._order:
            if expert not in protected:
                return expert
        raise RuntimeError("every resident expert is protected; no slot can be freed")

    def order(self) -> list[int]:
        return list(self._order)


PolicyFactory = Callable[[int, int], EvictionPolicy]  # (layer, num_experts) -> policy


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


def _alloc(loc: TensorLoc, slots: int) -> mx.array:
    np_dtype, mx_dtype = _pool_dtypes(loc.dtype)
    # Built from numpy so the array owns a dense buffer (mx.zeros may be a broadcast scalar).
    arr = mx.array(np.zeros((slots, *loc.shape[1:]), dtype=np_dtype))
    if arr.dtype != mx_dtype:
        arr = arr.view(mx_dtype)
    mx.eval(arr)
    return arr


class LayerPool:
    """The slots of one MoE layer: pools, expert <-> slot tables, and the layer's policy."""

    def __init__(
        self,
        layer: int,
        tensors: list[PooledTensor],
        num_experts: int,
        slots: int,
        policy: EvictionPolicy,
    ):
        self.layer = layer
        self.tensors = tensors
        self.num_experts = num_experts
        self.policy = policy
        self.expert_bytes = sum(t.slot_bytes for t in tensors)
        self._allocate(slots)

    def _allocate(self, slots: int) -> None:
        self.slots = slots
        self.arrays: dict[str, mx.array] = {t.key: _alloc(t.loc, slots) for t in self.tensors}
        # Byte views of each pool; workers write through these (no MLX calls off the engine thread).
        self.views: dict[str, memoryview] = {
            k: memoryview(a).cast("B") for k, a in self.arrays.items()
        }
        self.slot_of = np.full(self.num_experts, -1, dtype=np.int64)
        self.expert_in = np.full(slots, -1, dtype=np.int64)
        self._free = list(range(slots - 1, -1, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def pool_bytes(self) -> int:
        return self.slots * self.expert_bytes

    @property
    def resident(self) -> list[int]:
        return [int(e) for e in self.expert_in if e >= 0]

    def slot_view(self, tensor: PooledTensor, slot: int) -> memoryview:
        n = tensor.slot_bytes
        return self.views[tensor.key][slot * n : (slot + 1) * n]

    def admit(self, experts: Iterable[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """Make room for `experts` (at most `slots` of them). Returns (hits, [(expert, slot) to
        read]). The caller guarantees no pending computation still reads an evicted slot."""
        experts = [int(e) for e in experts]
        if len(experts) > self.slots:
            raise ValueError(
                f"layer {self.layer}: {len(experts)} experts do not fit {self.slots} slots"
            )
        wanted = set(experts)
        hits, loads = [], []
        for e in experts:
            if self.slot_of[e] >= 0:
                hits.append(e)
                self.policy.touch(e)
        for e in experts:
            if self.slot_of[e] >= 0:
                continue
            if not self._free:
                self._evict(self.policy.victim(wanted))  # frees exactly one slot
            slot = self._free.pop()
            self.slot_of[e] = slot
            self.expert_in[slot] = e
            self.policy.insert(e)
            loads.append((e, slot))
        return hits, loads

    def _evict(self, expert: int) -> None:
        slot = int(self.slot_of[expert])
        self.slot_of[expert] = -1
        self.expert_in[slot] = -1
        self.policy.remove(expert)
        self._free.append(slot)

    def forget(self, loads: list[tuple[int, int]]) -> None:
        """Undo `admit` for reads that failed, so no slot claims bytes it does not hold."""
        for e, _slot in loads:
            if self.slot_of[e] >= 0:
                self._evict(e)

    def resize(self, new_slots: int) -> int:
        """Shrink (or grow) the pools, keeping the most valuable residents. Returns bytes
        released."""
        new_slots = max(1, min(int(new_slots), self.num_experts))
        if new_slots == self.slots:
            return 0
        old_bytes = self.pool_bytes
        keep = self.policy.order()[-new_slots:]  # most valuable last
        old_arrays, old_views, old_slot_of = self.arrays, self.views, self.slot_of
        for e in self.policy.order():
            self.policy.remove(e)
        self._allocate(new_slots)
        for e in keep:
            src = int(old_slot_of[e])
            slot = self._free.pop()
            for t in self.tensors:
                n = t.slot_bytes
                self.views[t.key][slot * n : (slot + 1) * n] = old_views[t.key][
                    src * n : (src + 1) * n
                ]
            self.slot_of[e] = slot
            self.expert_in[slot] = e
            self.policy.insert(e)
        for v in old_views.values():
            v.release()
        del old_arrays, old_views
        return max(0, old_bytes - self.pool_bytes)
