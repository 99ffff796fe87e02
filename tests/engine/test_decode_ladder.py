"""The checkpoints a decoding row keeps behind its newest token (prefix_cache/ladder.py)."""

from __future__ import annotations

from moed.daemon.engine.prefix_cache.ladder import DecodeLadder

START = 100  # where the generation started (the prompt's length)


def _climb(ladder: DecodeLadder, steps: int, state_bytes: int = 1) -> list[set[int]]:
    """The rungs after each step, as DecodeBatch keeps them."""
    rungs: set[int] = set()
    history = []
    for now in range(START, START + steps):
        rungs.add(now)
        rungs -= set(ladder.drop(rungs, now, START, state_bytes))
        history.append(set(rungs))
    return history


def test_rungs_thin_out_with_the_distance_and_never_come_back():
    history = _climb(DecodeLadder(max_checkpoints=1000, max_bytes=1 << 30), 600)
    for before, after in zip(history, history[1:]):
        assert after - before <= {max(after)}  # only the newest position ever joins
    last = history[-1]
    now = max(last)
    assert {now, now - 1, now - 2, now - 3} <= last  # every position close by
    for p in last:  # farther away, spacing at most half the distance
        assert now - p < 2 or (p - START) % (1 << ((now - p) // 2).bit_length() - 1) == 0
    assert len(last) <= 2 * (600).bit_length() + 2  # a few per doubling of the distance


def test_the_count_and_the_bytes_drop_the_farthest_first():
    by_count = _climb(DecodeLadder(max_checkpoints=4, max_bytes=1 << 30), 50)[-1]
    assert by_count == {START + 49, START + 48, START + 47, START + 46}
    by_bytes = _climb(DecodeLadder(max_checkpoints=8, max_bytes=300), 50, state_bytes=100)[-1]
    assert by_bytes == {START + 49, START + 48, START + 47}
    assert _climb(DecodeLadder(max_checkpoints=8, max_bytes=50), 5, state_bytes=100)[-1] == set()
