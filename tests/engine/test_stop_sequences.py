"""Stop sequences over streamed text deltas: cut exactly before the first match, across deltas."""

from __future__ import annotations

import pytest

from moed.daemon.engine.stop_sequences import StopSequences


def run(stops, deltas):
    matcher = StopSequences(stops)
    sent = [matcher.feed(d) for d in deltas]
    return "".join(sent) + matcher.flush(), matcher.matched


@pytest.mark.parametrize(
    "deltas",
    [["Hello wor", "ld. END here"], ["Hello world. E", "N", "D here"], ["Hello world. END here"]],
)
def test_cut_before_the_stop_however_it_is_split(deltas):
    assert run(["END"], deltas) == ("Hello world. ", "END")


def test_earliest_match_wins_and_a_false_start_is_released():
    assert run(["xyz", "cd"], ["ab", "x", "yab", "cdxyz"]) == ("abxyab", "cd")
    assert run(["stop"], ["a st", "ill going"]) == ("a still going", None)


def test_text_held_back_at_the_end_is_flushed():
    assert run(["END"], ["the E"]) == ("the E", None)


def test_nothing_after_the_match_is_sent():
    matcher = StopSequences(["."])
    assert matcher.feed("one. two") == "one"
    assert matcher.feed("three") == "" and matcher.flush() == ""


def test_no_stops_passes_text_through():
    assert run([], ["a", "b"]) == ("ab", None)
