"""The device failures MLX raises, sorted by message; the MLX versions that raise a failed Metal
command buffer where the daemon can catch it; and the faults that raise each at a sync point.

The messages are the exact strings MLX formats: `[METAL] Command buffer execution failed: {}.`
around Metal's localizedDescription (mlx/backend/metal/device.cpp since v0.32.0; before it, the
same words without the final period, thrown on Metal's completion thread), the allocators'
(mlx/backend/metal/allocator.cpp, mlx/backend/cuda/allocator.cpp) and CUDA's
`check_cuda_error`: `"{} failed: {}"` with the call's text and cudaGetErrorString
(mlx/backend/cuda/utils.cpp).
"""

from __future__ import annotations

import pytest

from moed.daemon.ground.device_errors import (
    DeviceFailure,
    catches_device_failures,
    classify,
)
from moed.daemon.ground.faults import (
    DEVICE_MESSAGES,
    DeviceFault,
    DeviceMessage,
    Faults,
    SyncPoint,
)

OOM, TIMEOUT, OTHER = DeviceFailure.OUT_OF_MEMORY, DeviceFailure.GPU_TIMEOUT, DeviceFailure.OTHER

REAL_MESSAGES = [
    # Metal command buffers, MLX >= 0.32 (raised at the next wait, on the waiting thread).
    (
        "[METAL] Command buffer execution failed: Insufficient Memory "
        "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory).",
        OOM,
    ),
    (
        "[METAL] Command buffer execution failed: Caused GPU Timeout Error "
        "(00000002:kIOGPUCommandBufferCallbackErrorTimeout).",
        TIMEOUT,
    ),
    (
        "[METAL] Command buffer execution failed: Impacting Interactivity "
        "(0000000e:kIOGPUCommandBufferCallbackErrorImpactingInteractivity).",
        TIMEOUT,
    ),
    # ... and as MLX before 0.32 worded them (its completion handler aborted the process).
    (
        "[METAL] Command buffer execution failed: Insufficient Memory "
        "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)",
        OOM,
    ),
    # Other Metal failures: nothing in place can be trusted.
    ("[METAL] Command buffer execution failed: Internal Error (0000000a:Internal Error).", OTHER),
    (
        "[METAL] Command buffer execution failed: Ignored (for causing prior/excessive GPU "
        "errors) (00000004:kIOGPUCommandBufferCallbackErrorSubmissionsIgnored).",
        OTHER,
    ),
    (
        "[METAL] Command buffer execution failed: Caused GPU Address Fault Error "
        "(0000000b:kIOGPUCommandBufferCallbackErrorPageFault).",
        OTHER,
    ),
    # Metal's allocator, on the calling thread (any MLX).
    (
        "[metal::malloc] Attempting to allocate 70000000000 bytes which is greater than the "
        "maximum allowed buffer size of 38654705664 bytes.",
        OOM,
    ),
    ("[metal::malloc] Resource limit (499000) exceeded.", OOM),
    ("[malloc] Unable to allocate 17179869184 bytes.", OOM),
    # CUDA's allocator: cudaErrorMemoryAllocation, through check_cuda_error.
    ("cudaMallocAsync(&data, size, stream) failed: out of memory", OOM),
    ("cudaMalloc(&data, size) failed: out of memory", OOM),
    ("cudaMallocManaged(&data, size) failed: out of memory", OOM),
    # Other CUDA failures.
    (
        "cudaGraphLaunch(graph_exec_, stream()) failed: an illegal memory access was encountered",
        OTHER,
    ),
    (
        "cudaGraphAddDependencies(graph_, from_nodes_.data(), to_nodes_.data(), "
        "from_nodes_.size()) failed: invalid argument",
        OTHER,
    ),
]


@pytest.mark.parametrize("message, kind", REAL_MESSAGES)
def test_each_real_message_is_classified(message, kind):
    assert classify(RuntimeError(message)) is kind


def test_ordinary_errors_are_not_device_failures():
    assert classify(MemoryError()) is OOM  # the CPU backend's std::bad_alloc
    assert classify(RuntimeError("[matmul] Last dimension of first input with shape ...")) is None
    assert classify(RuntimeError("debug fault: a step failed")) is None
    # Only MLX's RuntimeError carries a device failure.
    assert classify(ValueError("Insufficient Memory")) is None
    assert classify(KeyError("cudaMalloc(x) failed: out of memory")) is None


def test_every_fault_message_is_a_real_one():
    real = dict(REAL_MESSAGES)
    for message in DeviceMessage:
        assert DEVICE_MESSAGES[message] in real, message
    assert classify(RuntimeError(DEVICE_MESSAGES[DeviceMessage.METAL_INTERNAL])) is OTHER


@pytest.mark.parametrize(
    "version, catches",
    [
        ("0.31.2", False),  # the last release without PR #3523
        ("0.30.6", False),
        ("0.32.0", True),  # the first with it (its merge commit a025496c8 is in v0.32.0)
        ("0.32.1", True),
        ("0.32.4", True),
        ("0.33.0", True),
        ("1.0.0", True),
        ("0.32.0.dev20260501+1a2b3c4", False),  # a dev build of 0.32.0 before the merge
        ("0.32.0.dev20260613+a025496c", True),
        ("0.32.1.dev20260720", True),
        ("not a version", False),  # unknown: the restart path is always safe
        ("", False),
    ],
)
def test_which_mlx_catches_a_failed_command_buffer(version, catches):
    assert catches_device_failures(version) is catches


def test_device_faults_parse_and_fire_once_at_their_point():
    f = Faults.parse("metal_oom_at_router=3, metal_timeout_at_chunk=5")
    assert f.device == (
        DeviceFault(DeviceMessage.METAL_OOM, SyncPoint.ROUTER, 3),
        DeviceFault(DeviceMessage.METAL_TIMEOUT, SyncPoint.CHUNK, 5),
    )
    f.before_step(2)
    f.at(SyncPoint.ROUTER)  # not yet
    f.before_step(3)
    f.at(SyncPoint.FENCE)  # another point
    with pytest.raises(RuntimeError) as err:
        f.at(SyncPoint.ROUTER)
    assert classify(err.value) is OOM
    f.at(SyncPoint.ROUTER)  # once
    f.before_step(9)
    with pytest.raises(RuntimeError, match="kIOGPUCommandBufferCallbackErrorTimeout"):
        f.in_layer(1)
    for bad in ("metal_oom_at_nowhere=1", "bogus_at_router=1", "metal_oom_at_router=x"):
        with pytest.raises(ValueError):
            Faults.parse(bad)
