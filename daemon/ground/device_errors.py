"""What failed on the device: MLX's errors after a device failure, sorted by message into a closed
set, and whether the installed MLX raises them where the daemon can catch them.

Before ml-explore/mlx PR #3523 ("Catch error in CommandBuffer and poison the events", merged
2026-06-13, first released in MLX 0.32.0) a failed Metal command buffer threw on Metal's own
completion thread, which aborts the process: nothing could catch it, so the daemon was restarted
by its service manager. Since then the error is kept and thrown at the next wait on the waiting
thread (an `mx.eval`, a read-back), formatted as `[METAL] Command buffer execution failed:
<Metal's description>.`, and the arrays that depended on the buffer are poisoned.

The messages below are the ones MLX formats (mlx/backend/metal/device.cpp, allocator.cpp;
mlx/backend/cuda/allocator.cpp, utils.cpp); tests/processes/test_device_errors.py records them.
Imports no mlx: the version is handed in.
"""

from __future__ import annotations

import enum
import re

# The first MLX release with PR #3523 (its merge commit a025496c8 is in v0.32.0, not in v0.31.2).
FIRST_MLX_CATCHING_METAL_FAILURES = (0, 32, 0)
# Dev builds of 0.32.0 (version.h said 0.32.0 from 2026-04-22) before the merge lack it.
PR_3523_MERGED = 20260613


class DeviceFailure(str, enum.Enum):
    OUT_OF_MEMORY = "out_of_memory"  # a command buffer or an allocation ran out of memory
    GPU_TIMEOUT = "gpu_timeout"  # the GPU watchdog killed a command buffer that ran too long
    OTHER = "device_error"  # any other device failure: nothing in place can be trusted


# Metal's descriptions (localizedDescription of the command buffer's error) and the allocators'.
_OUT_OF_MEMORY = (
    "kIOGPUCommandBufferCallbackErrorOutOfMemory",
    "Insufficient Memory",
    "[metal::malloc]",  # a buffer over maxBufferLength, or the resource limit
    "[malloc] Unable to allocate",  # Metal's and CUDA's allocators
)
# cudaGetErrorString(cudaErrorMemoryAllocation), after check_cuda_error's "<call> failed: ".
_CUDA_OUT_OF_MEMORY = re.compile(r"\bcu\w+\(.*\) failed: out of memory")
_TIMEOUT = (
    "kIOGPUCommandBufferCallbackErrorTimeout",
    "kIOGPUCommandBufferCallbackErrorImpactingInteractivity",  # seen on 120K-token prefills
    "Caused GPU Timeout Error",
    "Impacting Interactivity",
)
_METAL = ("[METAL]", "kIOGPUCommandBufferCallbackError")
_CUDA_CALL_FAILED = re.compile(r"\bcu\w+\(.*\) failed: ")


def classify(exc: BaseException) -> DeviceFailure | None:
    """The device failure `exc` reports, or None for an ordinary error (a bug in a step). MLX
    raises std::runtime_error (RuntimeError); the CPU backend's std::bad_alloc is MemoryError."""
    if isinstance(exc, MemoryError):
        return DeviceFailure.OUT_OF_MEMORY
    if not isinstance(exc, RuntimeError):
        return None
    text = str(exc)
    if any(marker in text for marker in _OUT_OF_MEMORY) or _CUDA_OUT_OF_MEMORY.search(text):
        return DeviceFailure.OUT_OF_MEMORY
    if any(marker in text for marker in _TIMEOUT):
        return DeviceFailure.GPU_TIMEOUT
    if any(marker in text for marker in _METAL) or _CUDA_CALL_FAILED.search(text):
        return DeviceFailure.OTHER
    return None


_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:\.dev(\d{8}))?")


def catches_device_failures(mlx_version: str) -> bool:
    """Whether this MLX raises a failed Metal command buffer as a Python error with the dependent
    arrays poisoned (PR #3523), so that the process can survive it. An unreadable version is
    taken for an older one: the restart path is always safe."""
    match = _VERSION.match(mlx_version.strip())
    if match is None:
        return False
    release = tuple(int(part) for part in match.group(1, 2, 3))
    built = match.group(4)
    if release != FIRST_MLX_CATCHING_METAL_FAILURES or built is None:
        return release >= FIRST_MLX_CATCHING_METAL_FAILURES
    return int(built) >= PR_3523_MERGED
