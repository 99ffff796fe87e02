"""The STAGED landing's staging ring (experts/staging.py) and the CUDA memory advice it uses
(experts/cuda_memory.py), on the CPU backend: a ring row is written again only once the scatter
that reads it ran (shown to go wrong without that), abandoned loads give their rows back, a burst
the ring cannot hold lands through fresh host rows, and the advice picks CUDA 12's or CUDA 13's
call form (a fake runtime) and is skipped off CUDA."""

from __future__ import annotations

import ctypes
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from moed.daemon.experts import StreamingConfig, cuda_memory
from moed.daemon.experts.cache import LayerPool, PooledTensor
from moed.daemon.experts.landing import Landing
from moed.daemon.experts.policies import make_policy
from moed.daemon.experts.safetensors_index import TensorLoc
from moed.daemon.experts.staging import FREE, LANDED, READING, StagingRing

EXPERTS, SLOTS, ROW = 16, 12, (4, 8)


def staged_pool() -> LayerPool:
    loc = TensorLoc("w", Path("unused"), "F32", (EXPERTS, *ROW), 0, EXPERTS * 4 * 8 * 4)
    tensors = [PooledTensor("gate_proj", "weight", loc)]
    policy = make_policy("lru", EXPERTS, SLOTS)
    return LayerPool(0, tensors, EXPERTS, SLOTS, policy, Landing.STAGED)


def value(expert: int) -> np.ndarray:
    return np.full(ROW, expert + 1, dtype=np.float32)


def read(pool: LayerPool, loads: list[tuple[int, int]]):
    """What the read workers do: each load's bytes into its destination."""
    staging = pool.stage(loads)
    (tensor,) = pool.tensors
    for (expert, _slot), dest in zip(staging.loads, pool.destinations(staging, tensor)):
        dest[:] = value(expert).tobytes()
    return staging


def bursts(pool: LayerPool) -> dict[int, int]:
    """Bursts of three loads landed lazily, never evaluated in between, into a ring of 8 rows: the
    third has to reuse the first's rows, whose scatter has not run (and the fourth the second's).
    Returns slot -> expert it must hold."""
    want: dict[int, int] = {}
    outputs = []
    for b in range(4):
        loads = [(3 * b + i, 3 * b + i) for i in range(3)]
        pool.land(read(pool, loads))
        want.update({slot: e for e, slot in loads})
        outputs.append(pool.arrays["gate_proj.weight"].sum())  # a pending graph on this version
    mx.eval(*outputs)
    return want


def held(pool: LayerPool) -> dict[int, int]:
    arr = np.array(pool.arrays["gate_proj.weight"])
    return {slot: int(arr[slot, 0, 0]) - 1 for slot in range(SLOTS)}


def test_ring_rows_are_written_again_only_after_their_scatter_ran():
    pool = staged_pool()
    assert pool.ring is not None and pool.ring.rows == 8
    assert pool.ring.advised == 0  # the CPU backend: nothing to advise
    want = bursts(pool)
    assert held(pool) == want
    assert pool.ring.settles == 1  # the third burst waited once, for the first two's scatters


def test_without_the_settle_a_reused_row_corrupts_the_pool(monkeypatch):
    def settle_without_eval(self, pool_arrays):
        self.state = [FREE if s == LANDED else s for s in self.state]

    monkeypatch.setattr(StagingRing, "settle", settle_without_eval)
    pool = staged_pool()
    want = bursts(pool)
    got = held(pool)
    assert got != want  # the first two bursts' scatters read the last two's bytes
    assert [got[s] for s in range(6)] == [6, 7, 8, 9, 10, 11]


def test_abandoned_loads_free_their_rows_and_others_stay():
    pool = staged_pool()
    ring = pool.ring
    assert ring is not None
    a = read(pool, [(0, 0), (1, 1)])
    b = read(pool, [(2, 2)])
    assert ring.state[:3] == [READING] * 3
    pool.forget(a.loads)
    assert ring.state[:3] == [FREE, FREE, READING]
    pool.forget([(3, 3)])  # not a staging of the ring: nothing changes
    assert ring.state[2] == READING
    pool.land(b)
    assert ring.state[2] == LANDED
    assert held(pool)[2] == 2


def test_a_burst_larger_than_the_ring_lands_through_fresh_host_rows():
    pool = staged_pool()
    loads = [(e, e) for e in range(10)]
    staging = read(pool, loads)
    assert staging.first == -1 and staging.buffers
    pool.land(staging)
    assert {s: e for s, e in held(pool).items() if s < 10} == {e: e for e in range(10)}
    assert pool.ring is not None and FREE in pool.ring.state and LANDED not in pool.ring.state


def test_resize_runs_the_scatters_its_old_arrays_owe():
    pool = staged_pool()
    for b in range(2):
        _hits, loads = pool.admit(range(3 * b, 3 * b + 3))
        pool.land(read(pool, loads))
    assert pool.ring is not None and LANDED in pool.ring.state
    pool.resize(8)  # keeps the six loaded experts, moved by the device
    assert LANDED not in pool.ring.state
    arr = np.array(pool.arrays["gate_proj.weight"])
    assert [int(arr[pool.slot_of[e], 0, 0]) - 1 for e in range(6)] == list(range(6))


class _Fn:
    def __init__(self, fn):
        self.fn, self.argtypes, self.restype, self.calls = fn, None, None, []

    def __call__(self, *args):
        self.calls.append(args)
        return self.fn(*args)


class _FakeCudart:
    def __init__(self, version: int):
        def get_version(ref):
            ref._obj.value = version
            return 0

        def get_device(ref):
            ref._obj.value = 3
            return 0

        self.cudaRuntimeGetVersion = _Fn(get_version)
        self.cudaGetDevice = _Fn(get_device)
        self.cudaMemAdvise = _Fn(lambda *a: 0)
        self.cudaGetErrorString = _Fn(lambda rc: b"invalid value")
        self.cudaPointerGetAttributes = _Fn(lambda attrs, ptr: 0)


def test_cuda13_advice_passes_a_location_struct_by_value():
    lib = _FakeCudart(13000)
    rt = cuda_memory.CudaRuntime(lib, "libcudart.so.13")  # type: ignore[arg-type]
    rt.advise_host(4096, 1 << 20, rt.device())
    assert lib.cudaMemAdvise.argtypes[3] is cuda_memory._Location
    (p1, n1, a1, loc1), (_p2, _n2, a2, loc2) = lib.cudaMemAdvise.calls
    assert (p1.value, n1.value) == (4096, 1 << 20)
    assert (a1, loc1.type, loc1.id) == (3, 2, 0)  # SetPreferredLocation, the host
    assert (a2, loc2.type, loc2.id) == (5, 1, 3)  # SetAccessedBy, GPU 3


def test_cuda12_advice_passes_a_device_ordinal():
    lib = _FakeCudart(12080)
    rt = cuda_memory.CudaRuntime(lib, "libcudart.so.12")  # type: ignore[arg-type]
    rt.advise_host(4096, 1 << 20, 0)
    assert lib.cudaMemAdvise.argtypes[3] is ctypes.c_int
    assert [(a, loc) for _p, _n, a, loc in lib.cudaMemAdvise.calls] == [(3, -1), (5, 0)]


def test_an_advice_error_names_the_call():
    lib = _FakeCudart(13000)
    lib.cudaMemAdvise = _Fn(lambda *a: 1)
    rt = cuda_memory.CudaRuntime(lib, "libcudart.so.13")  # type: ignore[arg-type]
    with pytest.raises(OSError, match="SetPreferredLocation.*invalid value"):
        rt.advise_host(4096, 4096, 0)


def test_off_cuda_there_is_nothing_to_advise():
    arr = mx.array(np.zeros(1024, dtype=np.float32))
    assert cuda_memory.runtime() is None
    assert cuda_memory.advise_host(arr) is False
    assert cuda_memory.address(arr) != 0


def test_the_default_landing_is_staged_on_cuda_only():
    assert Landing.AUTO.resolve(on_cuda=True) is Landing.STAGED
    assert Landing.AUTO.resolve(on_cuda=False) is Landing.DIRECT
    assert Landing.DIRECT.resolve(on_cuda=True) is Landing.DIRECT
    assert StreamingConfig().landing is Landing.AUTO
    loc = TensorLoc("w", Path("unused"), "F32", (EXPERTS, *ROW), 0, EXPERTS * 4 * 8 * 4)
    pool = LayerPool(
        0,
        [PooledTensor("gate_proj", "weight", loc)],
        EXPERTS,
        SLOTS,
        make_policy("lru", EXPERTS, SLOTS),
        Landing.AUTO,
    )
    assert not pool.staged and pool.ring is None and pool.views  # the CPU backend: DIRECT
