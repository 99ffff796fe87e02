"""The per-layer progress hook (model/layer_progress.py) changes no token: a model whose layers
are evaluated one by one in prompt chunks gives the tokens of the plain mlx-lm model, resident and
streamed, attention-only and hybrid; it reports each layer of each prompt chunk, and nothing in
decode steps."""

from __future__ import annotations

import pytest
from mlx_lm.utils import load_model

from moed.daemon.model.layer_progress import watch_layers
from tests.fixtures.matrix import first_fast
from tests.fixtures.reference import SAMPLER, decode, streaming

# The long prompt of the streaming tests: its chunks route to every expert of a layer.
PROMPT = [(7 * i + 3) % 300 + 3 for i in range(150)]
CHUNK = 64  # several prompt chunks
MAX_TOKENS = 6


@pytest.mark.parametrize("arch", first_fast(["qwen3_moe", "qwen3_5_moe", "qwen3_next"]))
def test_hooked_layers_give_the_same_tokens(checkpoint_factory, arch):
    path = checkpoint_factory(arch)
    model, _ = load_model(path)
    want = decode(model, PROMPT, MAX_TOKENS, prefill_step_size=CHUNK)
    want_sampled = decode(model, PROMPT, MAX_TOKENS, SAMPLER, prefill_step_size=CHUNK)
    layers = []
    count = watch_layers(model, lambda: layers.append(1))
    assert count == len(model.layers) and count >= 2
    assert decode(model, PROMPT, MAX_TOKENS, prefill_step_size=CHUNK) == want
    # generate_step reads the prompt but its last token in chunks; decode steps report nothing.
    chunks = -(-(len(PROMPT) - 1) // CHUNK)
    assert len(layers) == chunks * count
    assert watch_layers(model, lambda: None) == count  # hooking again wraps once
    assert decode(model, PROMPT, MAX_TOKENS, SAMPLER, prefill_step_size=CHUNK) == want_sampled

    streamed, streamer = streaming(path, "10%")
    try:
        watch_layers(streamed, lambda: None)
        assert decode(streamed, PROMPT, MAX_TOKENS, prefill_step_size=CHUNK) == want
    finally:
        streamer.close()
