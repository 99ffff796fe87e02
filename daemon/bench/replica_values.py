"""The values of a replica's tensors, made a chunk at a time (never a whole tensor in memory).

Random bits come from numpy's SFC64 generator read raw (over 1 GB/s on one core); each chunk has
its own stream, keyed by the seed, the tensor (or module) and the chunk's first element, so any
chunk can be made on its own and the same seed writes the same bytes.

The values keep a random model's activations finite and its routing spread: dequantized weights
are zero-mean (bias = -mid x scale) with a standard deviation of 1/sqrt(fan_in) (a layer keeps its
input's scale, the router's logits have a std near 1), each group's scale jittered by +-10%.
"""

from __future__ import annotations

import zlib

import numpy as np

from moed.daemon.bench.replica_layout import Dtype, Fill, TensorSpec

JITTER = 0.1  # each group's scale within +-10% of the layer's


def values(spec: TensorSpec, seed: int, start: int, count: int) -> np.ndarray:
    """Elements [start, start + count) of `spec`, flattened, in its dtype's bytes (uint16 for
    bfloat16)."""
    if spec.fill is Fill.PACKED:
        words = _raw(seed, spec.name, start, (count + 1) // 2).view(np.uint32)
        return words[:count]
    if spec.fill in (Fill.SCALES, Fill.BIASES):
        # Keyed by the module, not the tensor: a bias is -mid times its own group's scale.
        jitter = _uniform(seed, spec.module, start, count)
        levels = 2**spec.bits - 1
        code_std = np.sqrt(((levels + 1) ** 2 - 1) / 12.0)  # of codes uniform on 0..levels
        scale = (1.0 + JITTER * (2.0 * jitter - 1.0)) / (code_std * np.sqrt(spec.fan_in))
        out = scale if spec.fill is Fill.SCALES else -0.5 * levels * scale
        return _as(spec.dtype, out)
    if spec.fill is Fill.ONES:
        return _as(spec.dtype, np.ones(count, dtype=np.float32))
    if spec.fill is Fill.A_LOG:
        return _as(spec.dtype, np.log1p(15.0 * _uniform(seed, spec.name, start, count)))
    return _as(spec.dtype, _uniform(seed, spec.name, start, count) - 0.5)  # SMALL


def _raw(seed: int, key: str, start: int, words: int) -> np.ndarray:
    stream = np.random.SFC64(np.random.SeedSequence([seed, zlib.crc32(key.encode()), start]))
    raw: np.ndarray = stream.random_raw(words)
    return raw


def _uniform(seed: int, key: str, start: int, count: int) -> np.ndarray:
    """float32 uniform on [0, 1), 16 bits of resolution (enough for a jitter)."""
    bits = _raw(seed, key, start, (count + 3) // 4).view(np.uint16)[:count]
    return bits.astype(np.float32) * np.float32(1.0 / 65536.0)


def _as(dtype: Dtype, x: np.ndarray) -> np.ndarray:
    f32 = np.ascontiguousarray(x, dtype=np.float32)
    if dtype is Dtype.F32:
        return f32
    if dtype is Dtype.BF16:
        return bfloat16_bits(f32)
    raise ValueError(f"no float values for {dtype.value}")


def bfloat16_bits(f32: np.ndarray) -> np.ndarray:
    """bfloat16 of float32 values, round to nearest even, as uint16 bit patterns."""
    bits = f32.view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    out: np.ndarray = (rounded >> np.uint32(16)).astype(np.uint16)
    return out
