"""Long prompts at the SSD's pace: under streaming a prompt chunk reads each expert it routes to
at most once (however many passes its experts need), so the bytes read per prompt token fall as
the chunk grows."""

from __future__ import annotations

import pytest

from tests.fixtures.matrix import first_fast
from tests.fixtures.reference import decode, streaming

# A long prompt: its chunks route to every expert of a layer, more than one slot holds.
PROMPT = [(7 * i + 3) % 300 + 3 for i in range(150)]


@pytest.mark.parametrize("budget", first_fast(["50%", 1], ["half", "one-slot"]))
def test_a_chunk_reads_each_expert_at_most_once(checkpoint_factory, budget):
    path = checkpoint_factory("qwen3_moe")
    read = {}
    for chunk in (8, 32, 256):
        model, streamer = streaming(path, budget)
        try:
            streamer.trace = []  # per forward pass, per layer: the distinct experts routed to
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
