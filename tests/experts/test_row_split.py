"""The device probe behind the overlapped decode path (experts/row_split.py): a step's rows may be
split over two gathers only where a row's bits do not depend on the call's other rows. MLX's CPU
kernels pass it; a device whose gathers fail it never takes the path, and its tokens stay the
resident model's."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from moed.daemon.experts.row_split import split_rows_exact
from moed.daemon.experts.streaming_switch import ProjSpec, StreamingSwitch
from tests.fixtures.matrix import first_fast
from tests.fixtures.reference import resident, step_logits, streaming

PROMPT = [3, 9, 12, 5, 7, 30, 2, 41, 8, 16, 22, 11, 4, 19, 27, 6, 13, 35]


@pytest.mark.parametrize("bits", first_fast([4, None], ["4-bit", "float"]))
def test_the_cpu_computes_each_row_alone(checkpoint_factory, bits):
    model, streamer = streaming(checkpoint_factory("qwen3_moe", bits=bits), "25%")
    try:
        switch = model.layers[0].mlp.switch_mlp
        assert split_rows_exact(switch, streamer.pools[0].arrays)
        assert streamer.overlap in streamer.tuner.switches  # probed as before
    finally:
        streamer.close()


def test_a_gather_that_depends_on_its_rows_fails_the_probe(checkpoint_factory):
    model, streamer = streaming(checkpoint_factory("qwen3_moe", bits=4), "25%")
    try:
        switch = model.layers[0].mlp.switch_mlp
        plain = switch._experts
        # As a device whose kernel choice follows the call's size: a row's bits move with it.
        object.__setattr__(
            switch, "_experts", lambda x, idx, s, p: plain(x, idx, s, p) * (1 + 1e-3 * idx.size)
        )
        assert not split_rows_exact(switch, streamer.pools[0].arrays)
    finally:
        streamer.close()


def test_rows_kept_together_never_overlap_and_stay_exact(checkpoint_factory):
    """What install_streaming does on a failing device: the overlapped path is off for good (the
    tuner never probes it on) and the logits are the resident model's, bit for bit."""
    path = checkpoint_factory("qwen3_moe", num_experts=16, top_k=4, bits=4)
    want = step_logits(resident(path), PROMPT)
    model, streamer = streaming(path, "25%", cache_policy="lru")
    try:
        streamer.keep_rows_together()
        got = step_logits(model, PROMPT)
        snap = streamer.snapshot()
        assert streamer.overlap not in streamer.tuner.switches
        assert not streamer.overlap.active
    finally:
        streamer.close()
    assert snap["misses"] > 0 and snap["overlapped"] == 0
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


def test_a_pool_without_float_tensors_is_probed():
    """An mxfp4 pool holds packed weights and byte scales only: the probe's activations fall back
    to float32, and MLX's CPU still computes each row alone."""
    projs, pool = {}, {}
    shapes = {"gate_proj": (32, 64), "up_proj": (32, 64), "down_proj": (64, 32)}  # (out, in)
    for name, (out, inp) in shapes.items():
        w = mx.random.normal((2, out, inp), key=mx.random.key(len(name)))
        wq, scales = mx.quantize(w, group_size=32, bits=4, mode="mxfp4")
        projs[name] = ProjSpec(name, True, group_size=32, bits=4, mode="mxfp4")
        pool[f"{name}.weight"], pool[f"{name}.scales"] = wq, scales
    assert all(mx.issubdtype(a.dtype, mx.integer) for a in pool.values())
    switch = StreamingSwitch("glu", projs, lambda up, gate: nn.silu(gate) * up, 0, None)
    assert split_rows_exact(switch, pool)
