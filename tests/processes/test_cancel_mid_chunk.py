"""A client that leaves while its prompt chunk is being read frees the engine within a layer, not
at the chunk's end (a lone prompt's chunk can take minutes on a large streamed model): the step
stops at the next decoder layer, its batch is dropped, and the daemon serves the next request as
before (a real daemon, each prompt layer slowed by a debug fault)."""

from __future__ import annotations

import time

import pytest

from moed.client import ProgressEvent, TokenEvent

pytestmark = pytest.mark.process

LAYERS = 10
LAYER_DELAY_MS = 500  # a chunk takes LAYERS x this (5 s); the cancel comes 1 s in
PROMPT = [5 + (i * 7) % 200 for i in range(48)]


def _tokens(client, prompt) -> list[int]:
    out = []
    for event in client.generate(prompt_ids=prompt, max_tokens=4, raw=True, temperature=0):
        if isinstance(event, TokenEvent):
            out += event.ids
    return out


@pytest.mark.parametrize("mode", [("--resident",), ("--cache-budget", "30%")], ids=str)
def test_leaving_mid_chunk_frees_the_engine_within_a_layer(
    daemon_factory, checkpoint_factory, mode
):
    model = checkpoint_factory("qwen3_moe", num_layers=LAYERS)
    d = daemon_factory(
        model,
        *mode,
        "--prefix-cache",
        "0",
        "--prefix-cache-disk",
        "0",  # every request reads its whole prompt (through the slowed layers)
        env={"MOED_DEBUG_FAULTS": f"layer_delay_ms={LAYER_DELAY_MS}"},
    )
    with d.client() as c, d.client() as watch:
        before = _tokens(c, PROMPT)
        events = c.generate(prompt_ids=PROMPT[::-1], max_tokens=4, raw=True, progress=True)
        for event in events:
            assert isinstance(event, ProgressEvent), event  # the admission's, before the chunk
            break
        time.sleep(1.0)  # inside the chunk's second or third layer
        events.close()  # leaving the stream cancels the request
        left = time.monotonic()
        while watch.status()["active_requests"]:
            time.sleep(0.05)
        freed_after = time.monotonic() - left
        # The rest of the chunk alone is over 3.5 s; one layer is 0.5 s.
        assert freed_after < 2.5, freed_after
        assert _tokens(c, PROMPT) == before  # the new batch reads and decodes as the old one
    assert "a prompt step stopped at a layer" in d.log()
