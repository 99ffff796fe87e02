"""The lazy fence: a streaming layer's output is not evaluated when the layer returns, only at the
next router read-back or before one of the slots it reads is overwritten. These tests make slot
reuse as likely as it gets (one or two slots per layer, passes within a call, a policy that evicts
what was just used, two requests interleaved on one model) and compare with the resident model,
bit for bit; and they show that without the fence the same runs go wrong."""

from __future__ import annotations

from collections.abc import Container

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

from moed.daemon.experts import StreamingConfig, install_streaming
from moed.daemon.experts.fence import LazyFence
from moed.daemon.experts.policies import POLICIES, AllProtectedError, LRUPolicy
from tests.fixtures.matrix import first_fast
from tests.fixtures.reference import step_logits

MEMORY = 8 << 30
PROMPT = [(7 * i + 3) % 300 + 3 for i in range(40)]  # routes to every expert: passes at 1-2 slots


class MostRecentlyUsed(LRUPolicy):
    """Adversarial: evicts the expert used last, the slot a pending output most likely reads."""

    name = "mru-adversary"

    def victim(self, protected: Container[int]) -> int:
        for expert in reversed(self._order):
            if expert not in protected:
                return expert
        raise AllProtectedError("every resident expert is protected")


@pytest.fixture
def adversary(monkeypatch):
    monkeypatch.setitem(POLICIES, MostRecentlyUsed.name, MostRecentlyUsed)
    return MostRecentlyUsed.name


def streaming(path, budget, policy):
    model, _ = load_model(path, lazy=True)
    cfg = StreamingConfig(cache_budget=budget, memory_bytes=MEMORY, cache_policy=policy)
    streamer = install_streaming(model, path, cfg)
    mx.eval(model.parameters())
    return model, streamer


def logits(model, prompt=PROMPT) -> np.ndarray:
    out = model(mx.array(prompt)[None])
    mx.eval(out)
    return np.array(out)


def decode(model, prompt, n=8):
    return generate_step(mx.array(prompt), model, max_tokens=n, prefill_step_size=16)


def interleaved(model, prompts, n=8) -> list[list[int]]:
    """Two requests stepped alternately: neither's forward depends on the other's outputs."""
    gens = [decode(model, p, n) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(gens)))
    while active:
        for i in list(active):
            try:
                out[i].append(int(next(gens[i])[0]))
            except StopIteration:
                active.remove(i)
    return out


@pytest.mark.parametrize(
    "budget", first_fast(["25%", 1], ["25%", "1"])
)  # 1 byte: one slot per layer
def test_fence_keeps_every_output_exact(checkpoint_factory, adversary, budget):
    path = checkpoint_factory("qwen3_moe", num_experts=16, top_k=4)
    resident, _ = load_model(path)
    want_logits = logits(resident)
    prompts = [PROMPT[:20], PROMPT[20:]]
    want_tokens = [[int(t) for t, _ in decode(resident, p)] for p in prompts]
    del resident
    for policy in (adversary, "lru"):
        model, streamer = streaming(path, budget, policy)
        try:
            assert np.array_equal(logits(model), want_logits), policy  # bit for bit
            assert streamer.snapshot()["passes"] > 0  # the prompt needed several passes
            assert interleaved(model, prompts) == want_tokens, policy
            snap = streamer.snapshot()
        finally:
            streamer.close()
        assert snap["fences"] > 0  # passes of one call overwrite each other's slots
        assert snap["evictions"] > 0


@pytest.mark.parametrize("lane", [True, False])
def test_without_the_fence_outputs_go_wrong(checkpoint_factory, adversary, monkeypatch, lane):
    """The same multi-pass call with nothing deferred (nor submitted early): a later pass
    overwrites slots an earlier pass's unevaluated output reads (in the pool, or in the pass lane
    the passes alternate with), and the logits differ. So the exact runs above are exact because
    of the fence, not by luck."""
    path = checkpoint_factory("qwen3_moe", num_experts=16, top_k=4)
    resident, _ = load_model(path)
    want = logits(resident)
    del resident
    monkeypatch.setattr(LazyFence, "defer", lambda self, key, out, slots: None)
    monkeypatch.setattr(mx, "async_eval", lambda *arrays: None)
    model, streamer = streaming(path, 1, adversary)
    if not lane:
        streamer.drop_lane()
    try:
        assert not np.array_equal(logits(model), want)
    finally:
        streamer.close()


def test_one_host_sync_per_layer_when_decoding(checkpoint_factory):
    """Decode steps that fit the cache in one pass sync once per MoE layer (the router read)."""
    path = checkpoint_factory("qwen3_moe", num_experts=16, top_k=4)
    model, streamer = streaming(path, "50%", "lru")
    try:
        gen = decode(model, PROMPT[:12], n=12)
        next(gen)  # prefill and the first token
        before = streamer.snapshot()
        for _ in gen:
            pass
        after = streamer.snapshot()
    finally:
        streamer.close()
    steps = after["steps"] - before["steps"]
    layers = after["num_layers"]
    assert steps >= 10
    assert after["host_syncs"] - before["host_syncs"] == layers * steps
    assert after["fences"] == before["fences"]


@pytest.mark.parametrize(
    "arch,bits", [("qwen3_moe", None), ("qwen3_moe", 4), ("gpt_oss", 4)]
)  # gpt_oss: biases gathered per row
def test_decode_overlapping_reads_is_bit_exact(checkpoint_factory, arch, bits):
    """Decode steps that hit some experts and miss others compute the hits' rows while the misses
    are read: logits stay bit for bit the resident model's."""
    path = checkpoint_factory(arch, num_experts=16, top_k=4, bits=bits)
    resident, _ = load_model(path)
    want = step_logits(resident, PROMPT[:18])
    del resident
    model, streamer = streaming(path, "25%", "lru")
    try:
        got = step_logits(model, PROMPT[:18])
        snap = streamer.snapshot()
    finally:
        streamer.close()
    assert snap["overlapped"] > 0 and snap["misses"] > 0
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
