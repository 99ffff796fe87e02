"""Where should an expert read land on CUDA? (issue 22) A micro-benchmark of the pieces, run on the
GPU host before building the landing:

    python benchmarks/cuda_landing.py [--model-dir /tmp/moed-cuda-landing] [--bursts 40] [--burst 2]

Reads go through the store's own path (ExpertStore + ReadPool: O_DIRECT into a bounce buffer, the
bytes copied into the destination, 8 workers) of bench stream's checkpoint (Qwen3.6-35B-A3B expert
shapes, 4-bit, float32 scales), into:
  managed        a pool MLX made from host data (cudaMallocManaged), its slots read by the GPU just
                 before (today's DIRECT: the host write faults each page back)
  managed+advise the same, advised to the host (cudaMemAdvise PreferredLocation CPU, AccessedBy GPU)
  staging        a persistent MLX staging array advised to the host, then one device scatter into a
                 pool the device owns (the landing to build); `staging-noadvise`: not advised
  numpy          fresh numpy rows, then mx.array of them and the scatter (today's STAGED)
and the device side: the scatter alone, and a decode token's three gather_qmm on a pool the device
owns, on one in managed memory that migrated to the GPU, and on one advised to the host (read over
the bus). Variants alternate burst by burst; medians are printed.
"""

import argparse
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from moed.daemon.bench.bench_model import bench_config, write_bench_model
from moed.daemon.bench.reads import raw_pread_bandwidth
from moed.daemon.experts.cache import LayerPool, PooledTensor, _alloc_on_device, _pool_dtypes
from moed.daemon.experts.cuda_memory import advise_host, runtime
from moed.daemon.experts.landing import Staging
from moed.daemon.experts.policies import make_policy
from moed.daemon.experts.prefetch import ReadPool
from moed.daemon.experts.safetensors_index import CheckpointIndex
from moed.daemon.experts.store import ExpertStore, drop_page_cache

PROJS = ("gate_proj", "up_proj", "down_proj")
PARAMS = ("weight", "scales", "biases")
EXPERTS, SLOTS = 256, 64


def tensors_of(index: CheckpointIndex, layer: int) -> list[PooledTensor]:
    prefix = f"model.layers.{layer}.mlp.switch_mlp"
    return [PooledTensor(p, q, index[f"{prefix}.{p}.{q}"]) for p in PROJS for q in PARAMS]


def host_array(t: PooledTensor, rows: int) -> mx.array:
    """An MLX array made from host data: managed memory on CUDA (as cache._alloc)."""
    np_dtype, mx_dtype = _pool_dtypes(t.loc.dtype)
    arr = mx.array(np.zeros((rows, *t.loc.shape[1:]), dtype=np_dtype))
    arr = arr.view(mx_dtype) if arr.dtype != mx_dtype else arr
    mx.eval(arr)
    return arr


class Rows:
    """Destinations for ExpertStore.jobs_for: row i of each tensor (duck-types a LayerPool)."""

    def __init__(self, tensors, arrays=None, numpy=None):
        self.tensors = tensors
        self.arrays, self.numpy = arrays, numpy
        if arrays is not None:
            self.views = {k: memoryview(a).cast("B") for k, a in arrays.items()}

    def destination(self, staging: Staging, tensor: PooledTensor, i: int) -> memoryview:
        n = tensor.slot_bytes
        if self.numpy is not None:
            return memoryview(self.numpy[tensor.key][i]).cast("B")
        slot = staging.loads[i][1]
        return self.views[tensor.key][slot * n : (slot + 1) * n]


def gpu_read(arrays: dict, slots: list[int]) -> None:
    """The GPU reads these slots (as a gather_qmm of them would): their managed pages move there."""
    idx = mx.array(np.array(slots, dtype=np.int32))
    mx.eval(*(mx.sum(mx.take(a, idx, axis=0).astype(mx.float32)) for a in arrays.values()))


def timed_eval(*arrays) -> float:
    t0 = time.perf_counter()
    mx.eval(*arrays)
    mx.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default="/tmp/moed-cuda-landing")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--bursts", type=int, default=40)
    ap.add_argument("--burst", type=int, default=2, help="experts read per burst")
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()
    path = Path(args.model_dir)
    if not (path / "config.json").exists():
        t0 = time.perf_counter()
        config = bench_config(args.layers, 2048, 512, EXPERTS, 8, 8192, bits=4, group=64)
        write_bench_model(path, config, "float32", 0)
        print(f"wrote {path} in {time.perf_counter() - t0:.1f} s")
    rt = runtime()
    print(
        f"mlx {mx.__version__} on {mx.default_device()}; "
        f"cudart: {rt and rt.path} {rt and rt.version}"
    )
    index = CheckpointIndex(path)
    store = ExpertStore(index.files, bypass_page_cache=True)
    reader = ReadPool(store, args.workers)
    print(f"O_DIRECT on {len(store.direct)} of {len(store.fds)} files")
    raw = raw_pread_bandwidth(path, args.workers, 256 * 10**6, 1)["mb_s"]
    print(f"raw parallel pread, page cache dropped: {raw:.0f} MB/s")
    layers = list(range(args.layers))
    tens = {L: tensors_of(index, L) for L in layers}
    expert_bytes = sum(t.slot_bytes for t in tens[0])
    k = args.burst
    print(f"one expert {expert_bytes / 1e6:.2f} MB in {len(tens[0])} tensors; bursts of {k}")

    # Destinations, one per layer so a burst's pages are ones the GPU read (or wrote) before.
    direct = {
        L: LayerPool(L, tens[L], EXPERTS, SLOTS, make_policy("lru", EXPERTS, SLOTS)) for L in layers
    }
    advised = {L: {t.key: host_array(t, SLOTS) for t in tens[L]} for L in layers}
    n_adv = sum(advise_host(a) for d in advised.values() for a in d.values())
    print(f"advised {n_adv} arrays to the host")
    staging = {L: {t.key: host_array(t, k) for t in tens[L]} for L in layers}
    for d in staging.values():
        for a in d.values():
            advise_host(a)
    staging_na = {L: {t.key: host_array(t, k) for t in tens[L]} for L in layers}
    device_pool = {
        name: {L: {t.key: _alloc_on_device(t.loc, SLOTS) for t in tens[L]} for L in layers}
        for name in ("staging", "staging-noadvise", "numpy")
    }
    rng = np.random.default_rng(0)
    results: dict[str, dict[str, list[float]]] = {}

    def note(name: str, **vals: float) -> None:
        for key, v in vals.items():
            results.setdefault(name, {}).setdefault(key, []).append(v)

    def read(dest: Rows, loads: list[tuple[int, int]]) -> float:
        st = Staging(loads)
        res = reader.read(store.jobs_for(dest, st))  # type: ignore[arg-type]
        return res.bytes_read / res.wall_s / 1e6

    variants = ["managed", "managed+advise", "staging", "staging-noadvise", "numpy"]
    for b in range(args.bursts):
        L = layers[b % len(layers)]
        experts = sorted(rng.choice(EXPERTS, size=k, replace=False).tolist())
        slots = sorted(rng.choice(SLOTS, size=k, replace=False).tolist())
        loads = list(zip(experts, slots))
        rows = [(e, i) for i, e in enumerate(experts)]  # staging row i
        slot_idx = mx.array(np.array(slots, dtype=np.int32))
        for v in variants[b % len(variants) :] + variants[: b % len(variants)]:
            if v == "managed":
                gpu_read(direct[L].arrays, slots)
                note(v, mb_s=read(Rows(tens[L], direct[L].arrays), loads))
            elif v == "managed+advise":
                gpu_read(advised[L], slots)
                note(v, mb_s=read(Rows(tens[L], advised[L]), loads))
            elif v in ("staging", "staging-noadvise"):
                src = staging[L] if v == "staging" else staging_na[L]
                mb_s = read(Rows(tens[L], src), rows)
                t0 = time.perf_counter()
                pool = device_pool[v][L]
                for key in pool:
                    pool[key][slot_idx] = src[key]
                host = time.perf_counter() - t0
                dev = timed_eval(*pool.values())
                note(v, mb_s=mb_s, land_host_ms=host * 1e3, land_eval_ms=dev * 1e3)
            else:
                bufs = {
                    t.key: np.empty((k, *t.loc.shape[1:]), _pool_dtypes(t.loc.dtype)[0])
                    for t in tens[L]
                }
                mb_s = read(Rows(tens[L], numpy=bufs), rows)
                t0 = time.perf_counter()
                pool = device_pool[v][L]
                for t in tens[L]:
                    r = mx.array(bufs[t.key])
                    dtype = _pool_dtypes(t.loc.dtype)[1]
                    pool[t.key][slot_idx] = r.view(dtype) if r.dtype != dtype else r
                host = time.perf_counter() - t0
                dev = timed_eval(*pool.values())
                note(v, mb_s=mb_s, land_host_ms=host * 1e3, land_eval_ms=dev * 1e3)
    drop_page_cache(index.files)
    raw2 = raw_pread_bandwidth(path, args.workers, 256 * 10**6, 2)["mb_s"]
    print(f"raw parallel pread again: {raw2:.0f} MB/s")
    raw = (raw + raw2) / 2
    print(f"\nreads of {args.bursts // len(layers) * len(layers)} bursts of {k} experts (median):")
    print(f"{'landing':18} {'read MB/s':>9} {'x raw':>6} {'land host ms':>12} {'land eval ms':>12}")
    for v in variants:
        r = results[v]
        mb = statistics.median(r["mb_s"])
        host = statistics.median(r["land_host_ms"]) if "land_host_ms" in r else 0.0
        dev = statistics.median(r["land_eval_ms"]) if "land_eval_ms" in r else 0.0
        print(f"{v:18} {mb:9.0f} {mb / raw:6.2f} {host:12.3f} {dev:12.3f}")

    memcpy_rates(tens[0], k)
    compute_costs(tens[0])
    reader.close()
    store.close()


def memcpy_rates(tensors: list[PooledTensor], k: int) -> None:
    """No disk: one thread copying k experts' bytes into each destination (GB/s)."""
    t = max(tensors, key=lambda t: t.slot_bytes)
    src = np.random.default_rng(1).integers(0, 255, size=(k, t.slot_bytes), dtype=np.uint8)
    dests = {
        "managed (GPU read last)": host_array(t, SLOTS),
        "managed+advise": host_array(t, SLOTS),
    }
    advise_host(dests["managed+advise"])
    out: dict[str, list[float]] = {name: [] for name in [*dests, "numpy"]}
    for i in range(20):
        slots = list(range((i * k) % (SLOTS - k), (i * k) % (SLOTS - k) + k))
        for name, arr in dests.items():
            gpu_read({"a": arr}, slots)
            view = np.frombuffer(memoryview(arr).cast("B"), np.uint8).reshape(SLOTS, -1)
            t0 = time.perf_counter()
            view[slots] = src
            out[name].append(src.nbytes / (time.perf_counter() - t0) / 1e9)
        fresh = np.empty_like(src)
        t0 = time.perf_counter()
        fresh[:] = src
        out["numpy"].append(src.nbytes / (time.perf_counter() - t0) / 1e9)
    print(f"\nhost memcpy of {k} x {t.slot_bytes / 1e6:.2f} MB rows (median GB/s, one thread):")
    for name, rates in out.items():
        print(f"  {name:26} {statistics.median(rates):6.2f}")


def compute_costs(tensors: list[PooledTensor]) -> None:
    """A decode token's gate/up/down gather_qmm (8 experts, hidden 2048) on three pools."""
    by = {t.key: t for t in tensors}
    managed = {key: host_array(t, SLOTS) for key, t in by.items()}
    advised = {key: host_array(t, SLOTS) for key, t in by.items()}
    for a in advised.values():
        advise_host(a)
    device = {key: mx.contiguous(a * 1) for key, a in managed.items()}  # a kernel made them
    mx.eval(*device.values())
    rng = np.random.default_rng(2)
    x = mx.array(rng.standard_normal((1, 1, 1, 1, 2048)).astype(np.float32))

    def token(pool: dict, idx: mx.array) -> mx.array:
        def qmm(h, proj):
            w, s, b = (pool[f"{proj}.{q}"] for q in PARAMS)
            return mx.gather_qmm(h, w, s, b, rhs_indices=idx, transpose=True, group_size=64, bits=4)

        g, u = qmm(x, "gate_proj"), qmm(x, "up_proj")
        return qmm(g * mx.sigmoid(g) * u, "down_proj")

    times: dict[str, list[float]] = {
        "device-owned": [],
        "managed (migrated)": [],
        "advised to host": [],
    }
    pools = dict(zip(times, (device, managed, advised)))
    for i in range(60):
        idx = mx.array(
            rng.choice(SLOTS, size=(1, 8), replace=False).astype(np.uint32).reshape(1, 1, 8)
        )
        for name, pool in pools.items():
            dt = timed_eval(token(pool, idx))
            if i >= 10:  # the first touches migrate managed pages
                times[name].append(dt * 1e3)
    print("\none token's gate/up/down gather_qmm, 8 of 64 slots (median ms, eval + synchronize):")
    for name, ts in times.items():
        print(f"  {name:20} {statistics.median(ts):7.3f}")


if __name__ == "__main__":
    main()
