"""The STAGED landing (an opt-in for CUDA: experts/landing.py) gives the resident model's tokens.

Reads land in host rows and one scatter per burst makes a new version of the pool, so no fence is
needed; forced on here, on the CPU, at tiny budgets (many passes), for batches, with speculative
reads, across a shed (the device moves the kept experts) and with every expert preloaded (held).
"""

from __future__ import annotations

import pytest

from moed.daemon.experts.landing import Landing
from tests.fixtures.batch_decode import batch_tokens
from tests.fixtures.matrix import first_fast
from tests.fixtures.reference import SAMPLER, decode, resident, streaming

PROMPT = [(7 * i + 3) % 300 + 3 for i in range(150)]  # routes to every expert: several passes


def run(model, sampler=None, max_tokens=10, between=None) -> list[int]:
    return decode(model, PROMPT, max_tokens, sampler, between=between)


def staged(path, budget, **cfg):
    return streaming(path, budget, landing=Landing.STAGED, **cfg)


@pytest.mark.parametrize(
    "arch,bits",
    first_fast(
        [("qwen3_moe", None), ("qwen3_moe", 4), ("gpt_oss", 4), ("deepseek_v3", None)],
        ids=["qwen3_moe-f32", "qwen3_moe-4", "gpt_oss-4", "deepseek_v3-f32"],
    ),
)
def test_staged_tokens_identical_to_resident(checkpoint_factory, arch, bits):
    path = checkpoint_factory(arch, bits=bits)
    model = resident(path)
    want_greedy, want_sampled = run(model), run(model, SAMPLER)
    del model
    for budget in (1, "25%", "100%"):
        model, streamer = staged(path, budget)
        try:
            assert all(p.staged and not p.views for p in streamer.pools)
            assert run(model) == want_greedy, budget
            assert run(model, SAMPLER) == want_sampled, budget
            snap = streamer.snapshot()
        finally:
            streamer.close()
        assert snap["landing"] == "staged"
        assert snap["fences"] == 0  # a landing makes a new pool version: nothing waits
        assert snap["bytes_read"] == snap["misses"] * snap["expert_bytes"]


def test_staged_batch_across_passes_is_exact(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe", bits=4)
    prompts = [[17 + 29 * i] for i in range(6)]
    want = batch_tokens(resident(path), prompts)
    model, streamer = staged(path, "25%")
    try:
        assert batch_tokens(model, prompts) == want
        assert streamer.snapshot()["passes"] > 0
    finally:
        streamer.close()


@pytest.mark.slow
def test_staged_speculation_shed_and_hold_are_exact(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe", num_layers=4, num_experts=16)
    want = run(resident(path), max_tokens=16)

    model, streamer = staged(path, "50%", prefetch_next=True)
    try:
        assert run(model, max_tokens=16) == want
        assert streamer.snapshot()["prefetch_hits"] > 0
    finally:
        streamer.close()

    # A shed mid-generation: the kept experts are moved by the device into the smaller pools.
    model, streamer = staged(path, "100%")
    try:
        got = run(model, max_tokens=16, between=lambda i: i == 4 and streamer.shed(0.5))
        assert got == want
        assert streamer.slots == [8] * 4
    finally:
        streamer.close()

    # Every expert preloaded: the layers are held and routed on the device.
    model, streamer = staged(path, "100%")
    try:
        streamer.preload([list(range(16))] * 4)
        assert run(model, max_tokens=16) == want
        snap = streamer.snapshot()
        assert snap["host_syncs"] == 0 and snap["bytes_read"] == 0
    finally:
        streamer.close()
