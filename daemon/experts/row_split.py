"""Whether this device computes a gathered expert row the same when the call holds fewer rows.

The overlapped decode path (streaming_switch.py `_overlapped`) computes a step's rows in two
gathers, the resident experts' first, and is bit-identical to mlx-lm's one gather only where a
row's result does not depend on the call's other rows. MLX's CPU kernels compute each row alone;
its CUDA backend picks kernels by the call's shape (on an H200 a split decode step's
log-probabilities differed from resident's in the last bits, benchmarks/prompt_exactness.py).
So it is measured once per model on this device, on random weights of a layer's own pool shapes
and quantization, and a device where it fails never takes that path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:  # types only: the switch module is the probe's caller's
    from moed.daemon.experts.streaming_switch import StreamingSwitch

PROBE_SLOTS = 4  # experts in the probe's pool
PROBE_ROUTES = 8  # one token's rows (top-k of a typical MoE)


def split_rows_exact(
    switch: StreamingSwitch, pool: dict[str, mx.array], dtype: mx.Dtype | None = None
) -> bool:
    """One token's rows through `switch`'s expert function as one gather (mlx-lm's call) and as
    two (the overlapped path): True when every row is bit-identical. `dtype`: the activations'
    (the model's); by default the pool's float tensors' (affine scales, weights unquantized)."""
    key = mx.random.key(0)
    rand = {}
    for name, a in pool.items():
        key, sub = mx.random.split(key)
        shape = (PROBE_SLOTS, *a.shape[1:])
        if mx.issubdtype(a.dtype, mx.integer):  # packed quantized weights: any bits
            rand[name] = mx.random.randint(0, 1 << 30, shape, key=sub).astype(a.dtype)
        else:
            rand[name] = (0.05 * mx.random.normal(shape, key=sub)).astype(a.dtype)
    hidden = switch.input_dims(rand)
    if dtype is None:  # an mxfp4 pool holds no float tensor: its scales are bytes too
        floats = [a.dtype for a in rand.values() if not mx.issubdtype(a.dtype, mx.integer)]
        dtype = floats[0] if floats else mx.float32
    key, sub = mx.random.split(key)
    x = mx.random.normal((1, 1, 1, 1, hidden), key=sub).astype(dtype)
    idx = (mx.arange(PROBE_ROUTES, dtype=mx.uint32) % PROBE_SLOTS).reshape(1, 1, -1)
    whole = switch.expert_rows(x, idx, rand).reshape(PROBE_ROUTES, -1)
    rows = mx.broadcast_to(x, (1, 1, PROBE_ROUTES, 1, hidden)).reshape(-1, 1, hidden)
    half = PROBE_ROUTES // 2 + 1  # unequal halves, as a step's hits and misses are
    flat = idx.reshape(-1)
    parts = [
        switch.expert_rows(rows[:half], flat[:half], rand),
        switch.expert_rows(rows[half:], flat[half:], rand),
    ]
    split = mx.concatenate(parts).reshape(PROBE_ROUTES, -1)
    return bool(mx.array_equal(whole, split, equal_nan=True).item())
