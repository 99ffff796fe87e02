"""Long prompts at the SSD's pace: under streaming a prompt chunk reads each expert it routes to
at most once (however many passes its experts need), so the bytes read per prompt token fall as
the chunk grows."""

from __future__ import annotations

from contextlib import nullcontext

import pytest

from tests.fixtures.batch_decode import batch_tokens
from tests.fixtures.matrix import first_fast
from tests.fixtures.reference import decode, resident, streaming

# A long prompt: its chunks route to every expert of a layer, more than one slot holds.
PROMPT = [(7 * i + 3) % 300 + 3 for i in range(150)]


@pytest.mark.parametrize("budget", first_fast(["50%", 1], ["half", "one-slot"]))
def test_a_chunk_reads_each_expert_at_most_once(checkpoint_factory, budget):
    path = checkpoint_factory("qwen3_moe")
    read = {}
    for chunk in (8, 32, 256):
        model, streamer = streaming(path, budget)
        try:
            streamer.record_routing()  # per forward pass, per layer: the distinct experts routed to
            decode(model, PROMPT, 1, prefill_step_size=chunk)
            snap = streamer.snapshot()
        finally:
            streamer.close()
        distinct = sum(len(layer) for step in streamer.trace for layer in step)
        assert snap["misses"] <= distinct  # never twice in one pass, whatever the passes
        if budget == 1:
            assert snap["passes"] > 0  # the chunk needed more experts than a layer holds
        read[chunk] = snap["bytes_read"]
    assert read[256] < read[32] < read[8]


@pytest.mark.parametrize("arch", first_fast(["qwen3_moe", "qwen3_5_moe"]))
def test_a_dropped_prompt_chunk_reads_no_expert_of_the_last_layer(checkpoint_factory, arch):
    """mlx-lm keeps only a prompt chunk's caches: inside the engine's scope the last layer's
    streamed experts are neither routed nor read for a chunk, and every token is the same."""
    path = checkpoint_factory(arch)
    prompts = [PROMPT[:90], PROMPT[30:150]]  # two rows reading several chunks side by side
    want = batch_tokens(resident(path), prompts, prefill_chunk=32)
    read, skipped = {}, {}
    for skip in (False, True):
        model, streamer = streaming(path, "50%")
        try:
            scope = streamer.steps.unused_output if skip else nullcontext
            got = batch_tokens(model, prompts, prefill_chunk=32, unused_output=scope)
            assert got == want, f"skip={skip}"
            read[skip] = streamer.snapshot()["bytes_read"]
            skipped[skip] = streamer.unused_output.skipped
        finally:
            streamer.close()
    assert skipped == {False: 0, True: 4}  # 90 and 120 tokens less the last: 3 chunks, then 1
    assert read[True] < read[False]
