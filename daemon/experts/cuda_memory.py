"""Advice for CUDA's managed memory, through the CUDA runtime MLX's CUDA backend already loaded.

MLX on CUDA puts every array the host creates in cudaMallocManaged memory, whose pages migrate to
whichever processor touched them last: a host write into a page the GPU read faults it back first
(BENCHMARKS.md, issue 22). `advise_host` keeps an array's pages in host memory and maps them for
the GPU (cudaMemAdvise SetPreferredLocation = the CPU, SetAccessedBy = the GPU), so the host writes
at memory speed and the GPU reads them over the bus without migrating them. Off CUDA (Metal, the
CPU backend) there is nothing to advise and it returns False.

ctypes on the process's own libcudart (found in /proc/self/maps): CUDA 13's cudaMemAdvise takes a
`cudaMemLocation {int type; int id;}` by value, CUDA 12's a device ordinal (-1: the CPU).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import mlx.core as mx

log = logging.getLogger("moed.experts")

# <driver_types.h>
_ADVISE_PREFERRED_LOCATION = 3  # cudaMemAdviseSetPreferredLocation
_ADVISE_ACCESSED_BY = 5  # cudaMemAdviseSetAccessedBy
_LOCATION_DEVICE = 1  # cudaMemLocationTypeDevice
_LOCATION_HOST = 2  # cudaMemLocationTypeHost
_CPU_DEVICE_ID = -1  # cudaCpuDeviceId (CUDA 12's int form)
_MEMORY_TYPE_MANAGED = 3  # cudaMemoryTypeManaged


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CudaRuntime:
    """The few libcudart calls the landing needs."""

    def __init__(self, lib: ctypes.CDLL, path: str):
        self.path = path
        self._lib = lib
        version = ctypes.c_int(0)
        lib.cudaRuntimeGetVersion(ctypes.byref(version))
        self.version = version.value
        self._advise = lib.cudaMemAdvise
        location = _Location if self.version >= 13000 else ctypes.c_int
        self._advise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, location]
        self._advise.restype = ctypes.c_int
        lib.cudaGetErrorString.restype = ctypes.c_char_p

    def device(self) -> int:
        """The calling thread's current device (MLX made it current when it evaluated)."""
        dev = ctypes.c_int(0)
        self._check(self._lib.cudaGetDevice(ctypes.byref(dev)), "cudaGetDevice")
        return dev.value

    def _location(self, device: int | None) -> _Location | int:
        """`device` None: the host."""
        if self.version >= 13000:
            if device is None:
                return _Location(_LOCATION_HOST, 0)
            return _Location(_LOCATION_DEVICE, device)
        return _CPU_DEVICE_ID if device is None else device

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = self._lib.cudaGetErrorString(rc).decode(errors="replace")
            raise OSError(f"{what}: CUDA error {rc} ({msg})")

    def is_managed(self, ptr: int) -> bool:
        attrs = (ctypes.c_int * 64)()  # cudaPointerAttributes, its first field the memory type
        rc = self._lib.cudaPointerGetAttributes(attrs, ctypes.c_void_p(ptr))
        return rc == 0 and attrs[0] == _MEMORY_TYPE_MANAGED

    def advise_host(self, ptr: int, nbytes: int, device: int) -> None:
        """Pages of [ptr, ptr + nbytes) stay in host memory, mapped for `device`."""
        p, n = ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes)
        rc = self._advise(p, n, _ADVISE_PREFERRED_LOCATION, self._location(None))
        self._check(rc, "cudaMemAdvise(SetPreferredLocation, CPU)")
        rc = self._advise(p, n, _ADVISE_ACCESSED_BY, self._location(device))
        self._check(rc, f"cudaMemAdvise(SetAccessedBy, GPU {device})")


def _loaded_cudart() -> str | None:
    """The path of the libcudart this process mapped (MLX's CUDA backend links it)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if "/libcudart.so" in path:
            return path.strip()
    return None


def on_gpu() -> bool:
    """MLX computes on a GPU here (its default device: Metal or CUDA)."""
    return mx.default_device().type == mx.DeviceType.gpu


def on_cuda() -> bool:
    """MLX computes on a CUDA GPU here (its default device)."""
    return bool(mx.cuda.is_available()) and on_gpu()


@functools.cache
def runtime() -> CudaRuntime | None:
    """The CUDA runtime when MLX runs on CUDA, else None."""
    if not on_cuda():
        return None
    path = _loaded_cudart()
    if path is None:
        log.info("MLX runs on CUDA but no libcudart is mapped: managed memory is not advised")
        return None
    try:
        return CudaRuntime(ctypes.CDLL(path), path)
    except (OSError, AttributeError) as exc:
        log.warning("cannot use %s for memory advice: %s", path, exc)
        return None


def address(arr: mx.array) -> int:
    """The host address of an evaluated array's buffer (on CUDA: its managed pointer)."""
    # mx.array exports the buffer protocol; its stubs declare no __buffer__.
    view = memoryview(arr).cast("B")  # type: ignore[arg-type]
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def advise_host(arr: mx.array) -> bool:
    """Keep `arr`'s pages in host memory, mapped for the GPU (see the module doc). True when
    advised; False off CUDA or where the buffer is not managed memory (then host and GPU share
    pinned pages already, or there is no GPU)."""
    rt = runtime()
    if rt is None:
        return False
    mx.eval(arr)
    ptr = address(arr)
    if not rt.is_managed(ptr):
        return False
    rt.advise_host(ptr, arr.nbytes, rt.device())
    return True
