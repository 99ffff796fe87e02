"""Layers whose every expert is held route on the device (experts/held.py): no router read-back,
no fence, tokens identical to the resident model; the host's counters (usage for the profile,
hits per layer) come out the same as when the same calls are routed on the host."""

from __future__ import annotations

import numpy as np
import pytest
from mlx_lm.utils import load_model

from tests.fixtures.batch_decode import batch_tokens
from tests.fixtures.reference import SAMPLER, decode, streaming

PROMPT = [(7 * i + 3) % 300 + 3 for i in range(40)]
MAX_TOKENS = 12
CASES = [("qwen3_moe", None), ("qwen3_moe", 4), ("qwen3_5_moe", None), ("gpt_oss", 4)]


def preload_all(streamer, leave_out: dict[int, int] | None = None) -> None:
    """Every expert of every layer, but `leave_out` {layer: expert}."""
    leave_out = leave_out or {}
    streamer.preload(
        [
            [e for e in range(n) if leave_out.get(layer) != e]
            for layer, n in enumerate(streamer.layout.num_experts)
        ]
    )


@pytest.mark.parametrize("arch,bits", CASES, ids=[f"{a}-{b or 'f32'}" for a, b in CASES])
def test_held_layers_decode_with_no_host_sync_and_exact(checkpoint_factory, arch, bits):
    path = checkpoint_factory(arch, bits=bits)
    resident, _ = load_model(path)
    want_greedy, want_sampled = (
        decode(resident, PROMPT, MAX_TOKENS),
        decode(resident, PROMPT, MAX_TOKENS, SAMPLER),
    )
    del resident
    model, streamer = streaming(path)
    try:
        preload_all(streamer)
        before = streamer.snapshot()
        assert decode(model, PROMPT, MAX_TOKENS) == want_greedy
        assert decode(model, PROMPT, MAX_TOKENS, SAMPLER) == want_sampled
        after = streamer.snapshot()
    finally:
        streamer.close()
    assert after["host_syncs"] == before["host_syncs"]  # not one read-back or fence
    calls = after["layer_calls"] - before["layer_calls"]
    assert calls > 0 and after["device_routed"] - before["device_routed"] == calls
    assert after["misses"] == before["misses"] and after["bytes_read"] == 0


def test_device_tally_equals_host_routing(checkpoint_factory):
    """The same calls, routed on the device and (with a router trace on) on the host, give the
    same usage counts per expert and the same hits per layer."""
    path = checkpoint_factory("qwen3_moe", num_experts=16, top_k=4)
    results = []
    for host_routed in (False, True):
        model, streamer = streaming(path)
        try:
            preload_all(streamer)
            if host_routed:
                streamer.record_routing()  # the trace needs the choices on the host
            before = streamer.snapshot()
            decode(model, PROMPT, MAX_TOKENS)
            usage = streamer.usage_counts()
            after = streamer.snapshot()
        finally:
            streamer.close()
        syncs = after["host_syncs"] - before["host_syncs"]
        assert (syncs > 0) == host_routed
        hits = np.subtract(after["layer_hits"], before["layer_hits"])
        results.append((hits, usage))
    (dev_hits, dev_usage), (host_hits, host_usage) = results
    assert np.array_equal(dev_hits, host_hits) and dev_hits.sum() > 0
    for d, h in zip(dev_usage, host_usage):
        assert np.array_equal(d, h)


def test_layers_switch_between_held_and_streamed_mid_generation(checkpoint_factory):
    """Layer 1 lacks one expert: it streams (one host sync a step) until a token routes to that
    expert, then it is held too; later a shed shrinks every pool and all layers stream again.
    Tokens stay identical to resident throughout."""
    path = checkpoint_factory("qwen3_moe", num_experts=16, top_k=4)
    resident, _ = load_model(path)
    want = decode(resident, PROMPT, MAX_TOKENS)
    del resident
    model, streamer = streaming(path)
    seen = []

    def between(i):
        seen.append(streamer.snapshot())
        if i == MAX_TOKENS // 2:
            streamer.shed(0.5)  # on the engine thread: applied at the next step's first layer

    try:
        preload_all(streamer, leave_out={1: 3})
        assert decode(model, PROMPT, MAX_TOKENS, between=between) == want
    finally:
        streamer.close()
    assert seen[0]["host_syncs"] >= 1  # layer 1 streamed while it lacked an expert
    layers = seen[0]["num_layers"]
    steps = np.diff([s["steps"] for s in seen])
    syncs = np.diff([s["host_syncs"] for s in seen])
    # Before the shed: at most layer 1 syncs; after it, every layer does.
    assert all(s <= st for s, st in zip(syncs[: MAX_TOKENS // 2 - 1], steps))
    assert all(s >= layers * st for s, st in zip(syncs[MAX_TOKENS // 2 + 1 :], steps))
    assert seen[-1]["slots_per_layer"] == [8] * layers


def test_held_batch_rows_are_exact(checkpoint_factory):
    """A batch of decoding rows at a full, warm budget: no host sync, the resident tokens."""
    path = checkpoint_factory("qwen3_moe")

    prompts = [PROMPT[i : i + 5 + i] for i in range(4)]
    resident, _ = load_model(path)
    want = batch_tokens(resident, prompts)
    del resident
    model, streamer = streaming(path)
    try:
        preload_all(streamer)
        before = streamer.snapshot()
        assert batch_tokens(model, prompts) == want
        after = streamer.snapshot()
    finally:
        streamer.close()
    assert after["host_syncs"] == before["host_syncs"]
