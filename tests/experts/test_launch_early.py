"""`launch_early` (the default on a GPU: experts/streamer.py) gives the resident model's tokens.

A host-routed layer's output is submitted to the device as soon as it is built; forced on here,
on the CPU, with both landings, at tiny budgets (many passes), for a batch and with speculative
reads, whose slots the early evaluation must not race.
"""

from __future__ import annotations

import pytest

from moed.daemon.experts.cuda_memory import on_gpu
from moed.daemon.experts.landing import Landing
from tests.fixtures.batch_decode import batch_tokens
from tests.fixtures.reference import SAMPLER, decode, resident, streaming

PROMPT = [(7 * i + 3) % 300 + 3 for i in range(150)]  # routes to every expert: several passes


@pytest.mark.parametrize("landing", [Landing.DIRECT, Landing.STAGED])
def test_early_launch_tokens_identical_to_resident(checkpoint_factory, landing):
    path = checkpoint_factory("qwen3_moe", bits=4)
    model = resident(path)
    want_greedy, want_sampled = decode(model, PROMPT, 10), decode(model, PROMPT, 10, SAMPLER)
    del model
    for budget in (1, "25%", "100%"):
        model, streamer = streaming(path, budget, landing=landing, launch_early=True)
        try:
            assert streamer.launch_early
            assert decode(model, PROMPT, 10) == want_greedy, budget
            assert decode(model, PROMPT, 10, SAMPLER) == want_sampled, budget
            assert streamer.snapshot()["host_syncs"] > 0  # the host-routed path ran
        finally:
            streamer.close()


def test_early_launch_batch_and_speculation_are_exact(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe", num_layers=4, num_experts=16)
    prompts = [[17 + 29 * i] for i in range(6)]
    ref = resident(path)
    want_batch, want = batch_tokens(ref, prompts), decode(ref, PROMPT, 16)
    del ref
    model, streamer = streaming(path, "25%", launch_early=True)
    try:
        assert batch_tokens(model, prompts) == want_batch
        assert streamer.snapshot()["passes"] > 0
    finally:
        streamer.close()
    model, streamer = streaming(path, "50%", launch_early=True, prefetch_next=True)
    try:
        assert decode(model, PROMPT, 16) == want
        assert streamer.snapshot()["prefetch_hits"] > 0
    finally:
        streamer.close()


def test_early_launch_defaults_to_the_gpu_only(checkpoint_factory):
    path = checkpoint_factory("qwen3_moe")
    model, streamer = streaming(path, "25%")
    try:
        assert streamer.launch_early is on_gpu()
    finally:
        streamer.close()
