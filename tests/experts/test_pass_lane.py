"""The pass lane (experts/pass_lane.py): a multi-pass call alternates its passes between the pool
and the lane, each pass's reads landing while the one before computes. Bit for bit the resident
model's logits and tokens, with the same reads as without the lane (each expert of a call once),
for prompt chunks (hybrid and attention-only, quantized), a batch's union, after a shed, and with
speculative reads; a failed lane read raises and leaves no slot claiming bytes it lacks."""

from __future__ import annotations

import os
import shutil

import mlx.core as mx
import numpy as np
import pytest

from tests.fixtures.batch_decode import batch_tokens
from tests.fixtures.reference import SAMPLER, decode, resident, step_logits, streaming

PROMPT = [(7 * i + 3) % 300 + 3 for i in range(150)]  # routes to every expert: several passes


def _run(path, budget, lane: bool, **config):
    model, streamer = streaming(path, budget, **config)
    if not lane:
        streamer.drop_lane()
    return model, streamer


@pytest.mark.parametrize(
    ("arch", "bits"), [("qwen3_moe", 4), ("qwen3_5_moe", None)], ids=["qwen3_moe-q4", "hybrid"]
)
def test_lane_is_exact_and_reads_what_the_pool_alone_reads(checkpoint_factory, arch, bits):
    path = checkpoint_factory(arch, num_experts=16, top_k=4, bits=bits)
    ref = resident(path)
    want_logits = step_logits(ref, PROMPT, first=140)
    want, want_sampled = decode(ref, PROMPT, 8), decode(ref, PROMPT, 8, SAMPLER)
    del ref
    reads = {}
    for lane in (True, False):
        model, streamer = _run(path, "25%", lane)
        try:
            mx.eval(model(mx.array(PROMPT)[None]))  # one chunk on a cold cache
            snap = streamer.snapshot()
            got = step_logits(model, PROMPT, first=140)
            assert all(np.array_equal(a, b) for a, b in zip(got, want_logits)), lane
            assert decode(model, PROMPT, 8) == want, lane
            assert decode(model, PROMPT, 8, SAMPLER) == want_sampled, lane
        finally:
            streamer.close()
        assert snap["passes"] > 0
        assert (snap["lane_loads"] > 0) is lane
        reads[lane] = (snap["misses"], snap["bytes_read"])
    # The lane moves where a chunk's reads land, not how many: each expert once (what stays
    # cached afterwards differs, so later calls' reads may).
    assert reads[True] == reads[False] == (16 * 2, 16 * 2 * streamer.pools[0].expert_bytes)


def test_lane_serves_a_batch_union_and_speculation(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe", num_layers=4, num_experts=16)
    prompts = [[17 + 29 * i] for i in range(6)]  # a decode batch whose union spans passes
    ref = resident(path)
    want_batch, want = batch_tokens(ref, prompts), decode(ref, PROMPT, 12)
    del ref
    model, streamer = streaming(path, "25%")
    try:
        assert batch_tokens(model, prompts) == want_batch
        assert streamer.snapshot()["lane_loads"] > 0
    finally:
        streamer.close()
    model, streamer = streaming(path, "25%", prefetch_next=True)
    try:
        assert decode(model, PROMPT, 12) == want
        snap = streamer.snapshot()
        assert snap["lane_loads"] > 0 and snap["prefetched"] > 0
    finally:
        streamer.close()


def test_a_shed_narrows_the_lane_and_stays_exact(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe", num_experts=16, top_k=4)
    want = decode(resident(path), PROMPT, 8)
    model, streamer = streaming(path, "50%")
    try:
        assert streamer.lane is not None and streamer.lane.slots == 8
        before = streamer.lane.nbytes
        released = streamer.shed(0.5)
        assert streamer.lane.slots == 4  # as wide as the pools again
        assert released == streamer.pools[0].expert_bytes * 4 * len(streamer.pools) + before // 2
        assert decode(model, PROMPT, 8) == want
    finally:
        streamer.close()


def test_no_lane_where_every_expert_is_held(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe")
    _model, streamer = streaming(path, "100%")
    try:
        assert streamer.lane is None and streamer.plan.lane_bytes == 0
    finally:
        streamer.close()


def test_a_failed_lane_read_raises_and_claims_nothing(checkpoint_factory, tmp_path):
    src = checkpoint_factory("qwen3_moe", num_experts=16, top_k=4)
    path = tmp_path / "ck"
    shutil.copytree(src, path)
    model, streamer = streaming(path, "25%")
    try:
        loc = streamer.pools[1].tensors[0].loc
        os.truncate(loc.file, loc.offset)  # the last layer's experts are gone
        with pytest.raises(OSError):
            decode(model, PROMPT, 4)
        for pool in streamer.pools:  # every resident expert's slot holds its bytes
            assert len(pool.resident) == pool.slots - pool.free_slots
        assert all(streamer.pools[1].slot_of[e] < 0 for e in range(16))
    finally:
        streamer.close()
