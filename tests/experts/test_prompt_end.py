"""Reading ahead for the step that reads a prompt's last token (experts/prompt_end.py): every
token is the resident model's, right guesses or wrong, and prompts that end alike (a chat
template's generation prompt) find that step's experts read while their chunk ran."""

from __future__ import annotations

import random

import numpy as np
import pytest

from moed.daemon.engine.batch import DecodeBatch
from moed.daemon.engine.sampling import greedy
from moed.daemon.experts.prompt_end import RECENT, PromptEnd
from tests.fixtures.batch_decode import batch_tokens
from tests.fixtures.matrix import first_fast
from tests.fixtures.reference import resident, streaming

SUFFIX = [61, 7, 140, 3]  # the same end on every prompt, as a template's generation prompt
_rng = random.Random(5)
PROMPTS = [[_rng.randrange(3, 200) for _ in range(40)] + SUFFIX for _ in range(6)]


def _one_at_a_time(model, streamer, read_ahead: bool) -> tuple[list[list[int]], list[int]]:
    """Each prompt alone (one chunk, then the prompt-end step): its tokens, and the demand
    misses of each prompt-end step."""
    tokens, misses = [], []
    for prompt in PROMPTS:
        batch = DecodeBatch(
            model,
            [],
            max_batch=1,
            prefill_chunk=256,
            unused_output=streamer.steps.unused_output,
            prompt_end=streamer.steps.prompt_end if read_ahead else None,
        )
        uid = batch.insert(prompt, 4, greedy)
        out = batch.step()  # the chunk: every token but the last
        assert not out.tokens
        before = streamer.snapshot()["misses"]
        row = [t.token for t in batch.step().tokens if t.uid == uid]  # the prompt-end step
        misses.append(streamer.snapshot()["misses"] - before)
        while batch.rows:
            row += [t.token for t in batch.step().tokens if t.uid == uid]
        batch.close()
        tokens.append(row)
    return tokens, misses


@pytest.mark.parametrize("arch", first_fast(["qwen3_5_moe", "qwen3_moe"]))
def test_a_prompts_end_finds_its_experts_read_during_the_chunk(checkpoint_factory, arch):
    path = checkpoint_factory(arch)
    want = [batch_tokens(resident(path), [p], max_tokens=4)[0] for p in PROMPTS]
    got, misses, snaps = {}, {}, {}
    for read_ahead in (False, True):
        model, streamer = streaming(path, "25%", page_cache="bypass")
        try:
            got[read_ahead], misses[read_ahead] = _one_at_a_time(model, streamer, read_ahead)
            snaps[read_ahead] = streamer.snapshot()
        finally:
            streamer.close()
    assert got[True] == got[False] == want
    on = snaps[True]
    assert snaps[False]["prompt_end_reads"] == 0
    # From the second prompt on, the last prompt end's experts are read ahead and used.
    assert on["prompt_end_reads"] > 0 and on["prompt_end_hits"] > 0
    assert on["prompt_end_hits"] <= on["prompt_end_reads"] <= on["prefetched"]
    assert sum(misses[True][1:]) < sum(misses[False][1:])


def test_wrong_guesses_change_no_token(checkpoint_factory):
    """Guesses that are all wrong are read and given back, and every token is still the
    resident model's; rows ending in one step record the union of their choices."""
    path = checkpoint_factory("qwen3_5_moe")
    want = batch_tokens(resident(path), PROMPTS[:3], max_tokens=4)
    model, streamer = streaming(path, "25%", page_cache="bypass")
    rng = np.random.default_rng(0)
    try:
        for run in range(3):
            if run:  # the same rows end again: guess only experts their last end did not use
                for layer, pool in enumerate(streamer.pools):
                    used = set(streamer.prompt_end.experts[layer].tolist())
                    others = [e for e in range(pool.num_experts) if e not in used]
                    streamer.prompt_end.experts[layer] = rng.permutation(others)[: pool.slots]
            got = batch_tokens(
                model,
                PROMPTS[:3],
                max_tokens=4,
                unused_output=streamer.steps.unused_output,
                prompt_end=streamer.steps.prompt_end,
            )
            assert got == want
        snap = streamer.snapshot()
        assert snap["prompt_end_reads"] > 0
        assert snap["prompt_end_hits"] == 0  # none of the guesses was routed to
        # Three rows ended in one step: the union of their choices (more than one row's top 2).
        assert max(len(e) for e in streamer.prompt_end.experts if e is not None) > 2
    finally:
        streamer.close()


def test_prompt_ends_unlike_each_other_stop_the_reading_ahead():
    """Reading ahead follows how much a prompt end's experts repeat the one before's."""
    ends = PromptEnd(layers=2)
    assert ends.worthwhile and ends.shared is None  # nothing known yet: try
    for _ in range(4):  # a template's end: the same choices each time
        for layer in range(2):
            ends.record(layer, np.array([[[3, 5]]]))
    assert ends.shared == 1.0 and ends.worthwhile
    rng = np.random.default_rng(1)
    for step in range(RECENT):  # raw prompts ending anywhere: disjoint choices
        for layer in range(2):
            ends.record(layer, np.array([[[2 * (step % 30), 2 * (step % 30) + 1]]]))
    assert ends.shared == 0.0 and not ends.worthwhile
    ends.read(0, [7, 9])
    assert ends.record(0, rng.permutation([7, 8])[None, None]) == 1  # one of them was routed to


def test_reads_the_page_cache_answers_are_not_read_ahead(checkpoint_factory):
    """With the page cache trusted a read is a memory copy: not worth a core beside the chunk."""
    path = checkpoint_factory("qwen3_moe")
    model, streamer = streaming(path, "25%", page_cache="trust")
    try:
        _one_at_a_time(model, streamer, read_ahead=True)
        snap = streamer.snapshot()
    finally:
        streamer.close()
    assert snap["prompt_end_reads"] == 0 and snap["prefetched"] == 0
    assert streamer.prompt_end.shared is not None  # prompt ends still recorded
