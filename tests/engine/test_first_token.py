"""A row's first token leaves the batch in the step its prompt ends (engine/batch.py
`_first_tokens`), not at the step after, and every row still gets mlx-lm's tokens, each once."""

from __future__ import annotations

import pytest
from mlx_lm.utils import load_model

from moed.daemon.engine.batch import DecodeBatch
from moed.daemon.engine.sampling import greedy
from moed.protocol import FinishReason
from tests.fixtures.batch_decode import batch_tokens
from tests.fixtures.reference import streaming

PROMPT = [5, 17, 42, 9, 33, 71, 8, 2, 64, 11]
OTHER = [23, 4, 19, 88, 7]


@pytest.fixture(scope="module")
def resident(tiny_model):
    model, _ = load_model(tiny_model)
    return model


def run(batch: DecodeBatch, joins: dict[int, tuple[list[int], int]]):
    """Steps until every row ended; `joins[step]` inserts (prompt, max_tokens) before that step.
    Returns per row: its tokens, the step of each, the step its prompt ended, its finish."""
    rows: dict[int, dict] = {}
    step = 0
    while batch.rows or step <= max(joins):
        if step in joins:
            prompt, max_tokens = joins[step]
            rows[batch.insert(prompt, max_tokens, greedy)] = {"tokens": [], "at": [], "end": None}
        out = batch.step()
        for p in out.prompts:
            if p.done >= p.total:
                rows[p.uid]["end"] = step
        for tok in out.tokens:
            row = rows[tok.uid]
            assert row.get("finish") is None, "a token after the row's finish"
            row["tokens"].append(tok.token)
            row["at"].append(step)
            row["finish"] = tok.finish
        step += 1
    return list(rows.values())


def test_the_first_token_comes_in_the_step_the_prompt_ends(resident):
    (want,) = batch_tokens(resident, [PROMPT], max_tokens=6)
    batch = DecodeBatch(resident, [], max_batch=2, prefill_chunk=4)
    (row,) = run(batch, {0: (PROMPT, 6)})
    batch.close()
    assert row["tokens"] == want and row["finish"] is FinishReason.LENGTH
    assert row["at"][0] == row["end"]  # not one step later
    # The generator's step that would have handed it out hands out nothing new; then one a step.
    assert row["at"] == [row["end"], *range(row["end"] + 2, row["end"] + 7)]


def test_a_row_joining_a_decoding_batch_gets_its_first_token_early_too(resident):
    want = batch_tokens(resident, [PROMPT], max_tokens=8) + batch_tokens(
        resident, [OTHER], max_tokens=4
    )
    batch = DecodeBatch(resident, [], max_batch=2, prefill_chunk=4)
    rows = run(batch, {0: (PROMPT, 8), 4: (OTHER, 4)})
    batch.close()
    assert [r["tokens"] for r in rows] == want
    assert all(r["at"][0] == r["end"] for r in rows)


def test_a_first_token_that_ends_its_row_is_left_to_the_generator(resident):
    (want,) = batch_tokens(resident, [PROMPT], max_tokens=1)
    # One token asked for: it comes once, with its finish, at the generator's own step.
    batch = DecodeBatch(resident, [], max_batch=1, prefill_chunk=4)
    (row,) = run(batch, {0: (PROMPT, 1)})
    batch.close()
    assert row["tokens"] == want and row["finish"] is FinishReason.LENGTH
    assert row["at"] == [row["end"] + 1]
    # The first token is the end of sequence: it comes once, as a STOP.
    batch = DecodeBatch(resident, want, max_batch=1, prefill_chunk=4)
    (row,) = run(batch, {0: (PROMPT, 6)})
    batch.close()
    assert row["tokens"] == want and row["finish"] is FinishReason.STOP
    assert row["at"] == [row["end"] + 1]


def test_streamed_rows_get_their_first_token_early_with_the_resident_tokens(tiny_model, resident):
    want = batch_tokens(resident, [PROMPT, OTHER], max_tokens=5)
    model, streamer = streaming(tiny_model, "25%")
    try:
        batch = DecodeBatch(model, [], max_batch=2, prefill_chunk=4)
        rows = run(batch, {0: (PROMPT, 5), 1: (OTHER, 5)})
        batch.close()
    finally:
        streamer.close()
    assert [r["tokens"] for r in rows] == want
    assert all(r["at"][0] == r["end"] for r in rows)
