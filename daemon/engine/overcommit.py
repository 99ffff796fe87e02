"""A real out-of-memory on the GPU, for the `overcommit_at_<point>=N` fault (ground/faults.py):
an array larger than the device's whole memory, allocated and evaluated inside a step, so that
MLX's own allocator fails as it does when a step over-commits the device (CUDA:
`cudaMallocAsync(&data, size, stream) failed: out of memory`; Metal: `[metal::malloc] Attempting to
allocate ...`). benchmarks/cuda_oom_recovery.py drives it on a GPU host.

Refused on the CPU backend: there an allocation over memory is not refused but swaps, or the
kernel's OOM killer ends the process."""

from __future__ import annotations

import logging

import mlx.core as mx

from moed.daemon.experts.cuda_memory import on_gpu

log = logging.getLogger("moed.engine")

ROW_BYTES = 1 << 20  # MLX's dimensions are 32-bit: the bytes go in rows of a MiB
OVER = 2  # times the device's memory


def device_memory_bytes() -> int:
    """The GPU's memory: CUDA's total, Metal's unified memory."""
    info = mx.device_info()
    for key in ("total_memory", "memory_size"):
        value = info.get(key)
        if isinstance(value, int) and value > 0:
            return value
    raise RuntimeError(f"MLX does not say how much memory the device has: {sorted(info)}")


def check_overcommit_possible() -> None:
    """A configuration check: an overcommit fault needs a GPU."""
    if not on_gpu():
        raise ValueError(
            "debug_faults: overcommit needs a GPU (MLX's CUDA or Metal backend); on the CPU "
            "backend an allocation over memory swaps or is killed instead of failing"
        )


def overcommit_device() -> None:
    """Allocate and evaluate OVER x the device's memory; MLX raises its out-of-memory error."""
    rows = OVER * device_memory_bytes() // ROW_BYTES
    log.warning("debug fault overcommit: allocating %d bytes on the device", rows * ROW_BYTES)
    huge = mx.zeros((rows, ROW_BYTES), dtype=mx.uint8)
    mx.eval(huge)
    raise RuntimeError(  # never reached where the device's memory is what MLX says
        f"debug fault overcommit: {rows * ROW_BYTES} bytes were allocated; no out-of-memory"
    )
